"""The judge: is a kernel's output (and gradient) right? Used by ``flashrun verify``,
``flashrun bench`` and the tests alike.

:class:`Reference` computes the truth - float64 on the CPU, float32 on a GPU - for the (batch,
kv head) pairs to be checked (all of them, or the first and last for bench's quick check) and
the *yardstick*: PyTorch doing the same maths in the kernel's own dtype. It works one query
head and one block of query rows at a time, so its memory is one ``block x Nk`` score tile
whatever the batch, heads and length. :meth:`Reference.judge` compares a kernel's tensors with
it, by one policy: low-precision arithmetic cannot match the truth exactly, so a tensor passes when

    max|kernel - ref| <= FACTOR * max|yardstick - ref| + atol * max(1, max|ref|)
    and  ||kernel - ref|| / ||ref|| <= max_rel_l2

and nothing is NaN/Inf where the reference is finite, and every element was written. FACTOR = 2
follows flash-attention's own tests; ``atol`` is about one unit in the last place of the dtype
at magnitude 1, so a kernel is never failed for rounding that the dtype itself forces (e.g.
N = 1, where both errors are ~0). ``max_rel_l2`` guards against a yardstick that is itself
far off (it would otherwise excuse anything).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from flashrun.harness.inputs import Inputs, as_cached, from_e4m3, head_scales
from flashrun.harness.reference import attention_fp8_yardstick, attention_ref, cached_sequence, gather_kvcache
from flashrun.harness.shapes import Shape

def dequantized(inputs: Inputs) -> Inputs:
    """What fp8 inputs stand for. An e4m3 case's q, k, v times their descales, in float32 (exact).
    A KV-cache case's as its fp8 cache holds them, in the queries' dtype: the caches times their
    scales, the new keys and values as they are once quantized into the cache. The inputs
    themselves when nothing is fp8."""
    if inputs.descales is not None:
        q, k, v = (x8.float() * head_scales(d, x8.shape[1]) for x8, d in zip(inputs.leaves(), inputs.descales))
        return replace(inputs, q=q, k=k, v=v, descales=None)
    if inputs.k_scale is None:
        return inputs
    dtype = inputs.q.dtype
    new = {}
    if inputs.k_new is not None:
        new = {"k_new": as_cached(inputs.k_new, inputs.k_scale), "v_new": as_cached(inputs.v_new, inputs.v_scale)}
    return replace(inputs, k=from_e4m3(inputs.k, inputs.k_scale, dtype), v=from_e4m3(inputs.v, inputs.v_scale, dtype),
                   k_scale=None, v_scale=None, **new)


FACTOR = 2.0
SCORE_TILE_BYTES = {"cpu": 64 << 20, "cuda": 256 << 20}  # one block x Nk score matrix of the reference


@dataclass(frozen=True)
class Tolerance:
    atol: float
    max_rel_l2: float


TOLERANCE: dict[torch.dtype, Tolerance] = {
    torch.float16: Tolerance(atol=1e-3, max_rel_l2=1e-2),
    torch.bfloat16: Tolerance(atol=8e-3, max_rel_l2=5e-2),
    torch.float32: Tolerance(atol=1e-5, max_rel_l2=1e-4),
    # an output written in e4m3 (cuDNN's fp8 attention): 3 mantissa bits, so rounding alone is
    # ~3.6 % relative RMS (research/fp8.md: cuDNN showed 3.3-3.9 %); its yardstick rounds O too
    torch.float8_e4m3fn: Tolerance(atol=2 ** -5, max_rel_l2=1e-1),
}


@dataclass(frozen=True)
class Comparison:
    name: str  # "out", "dq", "dk", "dv"
    max_abs: float
    rel_l2: float
    yardstick: float  # max|yardstick - ref|
    bound: float  # the max_abs allowed
    nonfinite: int  # NaN/Inf where the reference is finite
    unwritten: int  # elements still holding the poison value
    first_bad: list[int] | None  # index of the worst element when failing
    passed: bool
    rel_bound: float | None = None  # the rel-L2 allowed, where it depends on the yardstick (compare_scaled)
    reference_nonfinite: int = 0  # compare_scaled: NaN/Inf in the reference itself (nothing to judge against)

    @property
    def ratio(self) -> float | None:
        """Kernel error over yardstick error (None when the yardstick is exact)."""
        return self.max_abs / self.yardstick if self.yardstick > 0 else None

    def reason(self) -> str:
        if self.passed:
            return ""
        if self.unwritten:
            return f"{self.name}: {self.unwritten} element(s) never written"
        if self.reference_nonfinite:
            return (f"{self.name}: the reference itself has {self.reference_nonfinite} NaN/Inf value(s): nothing to "
                    "judge against")
        if self.nonfinite:
            return f"{self.name}: {self.nonfinite} NaN/Inf value(s)"
        at = f" at {tuple(self.first_bad)}" if self.first_bad else ""
        if self.max_abs <= self.bound and self.rel_bound is not None:
            return f"{self.name}: rel-L2 error {self.rel_l2:.3g} > allowed {self.rel_bound:.3g}"
        return (f"{self.name}: max error {self.max_abs:.3g}{at} > allowed {self.bound:.3g} "
                f"(rel-L2 {self.rel_l2:.3g})")

    def to_json(self) -> dict:
        return {**asdict(self), "ratio": self.ratio}


def compare(name: str, out: torch.Tensor, ref: torch.Tensor, yardstick: torch.Tensor,
            poison: float | None = None) -> Comparison:
    """Judge ``out`` against ``ref`` (high precision) with ``yardstick`` (same dtype as ``out``),
    in float64 on ``out``'s device (on the H200 the copies to the CPU and the CPU's float64 maths
    took 7 of a cold offline verify's 38 s)."""
    tol = TOLERANCE[out.dtype]
    ref64 = ref.detach().to(out.device, torch.float64)
    out64 = out.detach().to(torch.float64)
    unwritten = int((out64 == poison).sum()) if poison is not None else 0
    finite_ref = torch.isfinite(ref64)
    nonfinite = int((~torch.isfinite(out64) & finite_ref).sum())
    diff = (out64 - ref64).abs()
    diff = torch.where(finite_ref, diff, torch.zeros_like(diff)).nan_to_num(nan=float("inf"))
    max_abs = float(diff.max()) if diff.numel() else 0.0
    ref_norm = float(ref64[finite_ref].norm())
    err_norm = float(diff[torch.isfinite(diff)].norm()) if torch.isfinite(diff).any() else float("inf")
    rel_l2 = err_norm / ref_norm if ref_norm > 0 else err_norm
    if nonfinite or unwritten:
        rel_l2 = float("inf")
    yard = (yardstick.detach().to(out.device, torch.float64) - ref64).abs()
    yard = torch.where(finite_ref, yard, torch.zeros_like(yard)).nan_to_num(nan=0.0, posinf=0.0)
    yard_max = float(yard.max()) if yard.numel() else 0.0
    ref_max = float(ref64[finite_ref].abs().max()) if finite_ref.any() else 0.0
    bound = FACTOR * yard_max + tol.atol * max(1.0, ref_max)
    passed = not nonfinite and not unwritten and max_abs <= bound and rel_l2 <= tol.max_rel_l2
    first_bad = None
    if not passed and diff.numel():
        first_bad = [int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)]
    return Comparison(name, max_abs, rel_l2, yard_max, bound, nonfinite, unwritten, first_bad, passed)


def compare_scaled(name: str, out: torch.Tensor, ref: torch.Tensor, yardstick: torch.Tensor,
                   dtype: torch.dtype | None = None) -> Comparison:
    """Judge a whole model's tensors (logits, gradients, losses), whose scale is arbitrary and
    whose error grows through the layers for any kernel: the same policy as :func:`compare` -
    no worse than FACTOR x the yardstick's own error - applied to both measures, each floored at
    the dtype's rounding relative to the tensor itself (a gradient of size 1e-4 gets no absolute
    allowance of 1e-3):

        max|out - ref|        <= FACTOR * max|yardstick - ref|  + atol * max|ref|
        ||out - ref|| / ||ref|| <= FACTOR * ||yardstick - ref|| / ||ref|| + atol

    A reference that is NaN/Inf anywhere fails the comparison (``reference_nonfinite``): a whole
    model's reference is finite, or it cannot judge. Computed in float64 on the tensors' own
    device (a model's logits are too large to copy).
    ``dtype``: the precision whose rounding floors the bounds, where ``out`` is not in it (a
    bf16 model's losses, collected as float64 numbers)."""
    atol = TOLERANCE[dtype or out.dtype].atol
    ref64, out64, yard64 = (t.detach().to(ref.device, torch.float64) for t in (ref, out, yardstick))
    finite_ref = torch.isfinite(ref64)
    nonfinite = int((~torch.isfinite(out64) & finite_ref).sum())

    def errors(x: torch.Tensor) -> tuple[torch.Tensor, float, float]:
        diff = torch.where(finite_ref, (x - ref64).abs(), torch.zeros_like(x)).nan_to_num(nan=float("inf"))
        ref_norm = float(ref64[finite_ref].norm()) or 1.0
        return diff, float(diff.max()) if diff.numel() else 0.0, float(diff.norm()) / ref_norm

    diff, max_abs, rel_l2 = errors(out64)
    _, yard_max, yard_rel = errors(yard64)
    ref_max = float(ref64[finite_ref].abs().max()) if finite_ref.any() else 0.0
    bound = FACTOR * yard_max + atol * ref_max
    rel_bound = FACTOR * yard_rel + atol
    reference_nonfinite = int((~finite_ref).sum())
    passed = not nonfinite and not reference_nonfinite and max_abs <= bound and rel_l2 <= rel_bound
    first_bad = None
    if not passed and diff.numel():
        first_bad = [int(i) for i in torch.unravel_index(diff.argmax().cpu(), diff.shape)]
    return Comparison(name, max_abs, rel_l2, yard_max, bound, nonfinite, 0, first_bad, passed, rel_bound,
                      reference_nonfinite)


class Reference:
    """The reference and the yardstick for one input set, on the checked (sequence, kv head) pairs.

    Dense inputs are ``(B, H, N, D)``; packed ones (``cu_seqlens_q``/``cu_seqlens_k`` given) are
    ``(total, H, D)`` with sequence ``b`` in rows ``cu[b]:cu[b+1]``. ``edges``: check batch
    elements {0, B-1} (a stride bug shows past the first element) and kv heads {0, H_kv-1},
    each with every query head it serves (so dk/dv are complete sums); otherwise every batch
    element (always every sequence of a packed batch) and head. ``grads``: also the gradients
    for ``inputs.dout``. ``window``, ``softcap``, ``alibi_slopes``: the variants, with
    :func:`~flashrun.harness.reference.attention_ref`'s meaning. ``fp8``: the inputs are what an
    e4m3 forward's hold (dequantized), and the yardstick is
    :func:`~flashrun.harness.reference.attention_fp8_yardstick` (FlashAttention-3's rule); ``fp8_out``: its
    output is e4m3, and so is the yardstick's. A KV-cache call
    (:meth:`for_kvcache`) is judged as the packed sequences it attends to.
    """

    cache: Inputs | None = None  # a KV-cache call's inputs (its output is (B, Nq, H, D))

    def __init__(self, inputs: Inputs, *, causal: bool, grads: bool, sm_scale: float | None = None,
                 edges: bool = False, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                 alibi_slopes: torch.Tensor | None = None, cu_seqlens_q: torch.Tensor | None = None,
                 cu_seqlens_k: torch.Tensor | None = None, fp8: bool = False, fp8_out: bool = False) -> None:
        if fp8_out and not fp8:
            raise ValueError("fp8_out is an fp8 forward's output format")
        if fp8 and (grads or softcap or alibi_slopes is not None or cu_seqlens_q is not None):
            raise ValueError("an fp8 reference is a dense forward's: no gradients, softcap, ALiBi or packing")
        q, k = inputs.q, inputs.k
        self.fp8, self.fp8_out = fp8, fp8_out
        self.packed = cu_seqlens_q is not None
        heads, kv_heads = q.shape[1], k.shape[1]  # (B, H, N, D) and packed (total, H, D) alike
        if self.packed:
            self._cu = (cu_seqlens_q.tolist(), cu_seqlens_k.tolist())
            batch = len(self._cu[0]) - 1
        else:
            batch = q.shape[0]
        self.causal, self.sm_scale = causal, sm_scale
        self.window, self.softcap, self.alibi_slopes = window, softcap, alibi_slopes
        self.group = heads // kv_heads
        self._batches = sorted({0, batch - 1}) if edges and not self.packed else list(range(batch))
        self._kv_heads = sorted({0, kv_heads - 1}) if edges else list(range(kv_heads))
        self._q_heads = [j * self.group + t for j in self._kv_heads for t in range(self.group)]
        device = q.device
        self._batch_idx = torch.tensor(self._batches, device=device)
        self._head_idx = torch.tensor(self._q_heads, device=device)
        self._kv_idx = torch.tensor(self._kv_heads, device=device)
        self.out, self.grads = self._compute(inputs, grads, upcast=True)
        self.yard_out, self.yard_grads = self._compute(inputs, grads, upcast=False)

    @classmethod
    def for_shape(cls, inputs: Inputs, shape: Shape, grads: bool, edges: bool = False,
                  fp8_out: bool = False) -> Reference:
        """The reference for ``inputs`` drawn for ``shape``: its mask and variants (packed and
        KV-cache calls too); ``fp8_out``: an e4m3 forward that writes e4m3."""
        if inputs.cache_seqlens is not None:
            return cls.for_kvcache(inputs, causal=shape.causal)
        if inputs.descales is not None:  # e4m3: FlashAttention-3's rule on what the inputs stand for
            return cls(dequantized(inputs), causal=shape.causal, grads=False, edges=edges, window=inputs.window,
                       fp8=True, fp8_out=fp8_out)
        return cls(inputs, causal=shape.causal, grads=grads, edges=edges, **inputs.reference_args())

    @classmethod
    def for_kvcache(cls, inputs: Inputs, *, causal: bool, sm_scale: float | None = None) -> Reference:
        """The reference for a KV-cache call (no gradients): the attention of each sequence's
        queries over its cached keys and then its new ones, gathered from the cache as it was
        before the call (:func:`~flashrun.harness.reference.gather_kvcache`). An fp8 cache is
        judged on what it holds (:func:`dequantized`): after the dequantization all the maths is
        the queries' dtype's, so the usual rule applies."""
        inputs = dequantized(inputs)
        q, k, v, cu_q, cu_k = gather_kvcache(inputs.q, inputs.k, inputs.v, inputs.cache_seqlens, inputs.block_table,
                                             inputs.k_new, inputs.v_new)
        reference = cls(Inputs(q, k, v, q), causal=causal, grads=False, sm_scale=sm_scale, window=inputs.window,
                        softcap=inputs.softcap, alibi_slopes=inputs.alibi_slopes, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        reference.cache = inputs
        return reference

    def slice_q(self, t: torch.Tensor) -> torch.Tensor:
        """(B, H, Nq, D) or (total_q, H, D) -> the checked (sequence, query head) pairs."""
        t = t.detach()
        return t.index_select(1, self._head_idx) if self.packed else \
            t.index_select(0, self._batch_idx).index_select(1, self._head_idx)

    def slice_kv(self, t: torch.Tensor) -> torch.Tensor:
        """(B, H_kv, Nk, D) or (total_k, H_kv, D) -> the checked (sequence, kv head) pairs."""
        t = t.detach()
        return t.index_select(1, self._kv_idx) if self.packed else \
            t.index_select(0, self._batch_idx).index_select(1, self._kv_idx)

    def judge(self, out: torch.Tensor, grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
              poison: float | None = None, cache: tuple[torch.Tensor, torch.Tensor] | None = None
              ) -> list[Comparison]:
        """Compare ``out`` (and ``(dq, dk, dv)``) with the reference; ``poison``: the value that
        marks an element the kernel never wrote. ``cache``: a KV-cache call's caches after it,
        whose slots for the new keys and values must hold exactly them."""
        if self.cache is not None:
            out = out.flatten(0, 1)  # (B, Nq, H, D) -> the packed rows
        checks = [compare("out", self.slice_q(out), self.out, self.yard_out, poison)]
        if cache is not None and self.cache is not None and self.cache.k_new is not None:
            for name, after, new in (("k_cache", cache[0], self.cache.k_new), ("v_cache", cache[1], self.cache.v_new)):
                checks.append(compare(name, self._appended(after), new, new))
        if grads is not None:
            if self.grads is None or self.yard_grads is None:
                raise ValueError("this Reference was built without gradients")
            for name, got, cut, want, yard in zip(("dq", "dk", "dv"), grads, (self.slice_q, self.slice_kv, self.slice_kv),
                                                  self.grads, self.yard_grads):
                checks.append(compare(name, cut(got), want, yard, poison))
        return checks

    def _appended(self, cache: torch.Tensor) -> torch.Tensor:
        """(B, new_keys, H_kv, D): each sequence's cache slots after its cached keys."""
        lengths, new = self.cache.cache_seqlens.tolist(), self.cache.k_new.shape[1]
        return torch.stack([cached_sequence(cache, self.cache.block_table, b, n + new)[n:]
                            for b, n in enumerate(lengths)])

    def _sequence(self, t: torch.Tensor, b: int, keys: bool) -> torch.Tensor:
        """Sequence ``b`` of ``t`` as ``(heads, n, D)``."""
        if not self.packed:
            return t[b]
        cu = self._cu[1 if keys else 0]
        return t[cu[b]:cu[b + 1]].transpose(0, 1)

    def _slope(self, b: int, h: int) -> torch.Tensor | None:
        if self.alibi_slopes is None:
            return None
        slopes = self.alibi_slopes
        return (slopes[b, h] if slopes.dim() == 2 else slopes[h]).reshape(1)

    def _compute(self, inputs: Inputs, grads: bool, upcast: bool
                 ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
        q, k, v, dout = (t.detach() for t in (inputs.q, inputs.k, inputs.v, inputs.dout))
        dtype = q.dtype if not upcast else torch.float64 if q.device.type == "cpu" else torch.float32
        budget = SCORE_TILE_BYTES.get(q.device.type, SCORE_TILE_BYTES["cpu"])

        def leaf(t: torch.Tensor) -> torch.Tensor:  # (N, D) -> (1, 1, N, D), a copy in the working dtype
            return t[None, None].to(dtype, copy=True).requires_grad_(grads)

        outs, dqs, dks, dvs = [], [], [], []  # per sequence: a list over the checked heads of (n, D)
        for b in self._batches:
            qb, kb, vb, dob = (self._sequence(t, b, keys) for t, keys in ((q, False), (k, True), (v, True),
                                                                            (dout, False)))
            n_q, n_k = qb.shape[1], kb.shape[1]
            block = max(16, budget // max(1, n_k * dtype.itemsize))
            outs.append([]), dqs.append([]), dks.append([]), dvs.append([])
            for j in self._kv_heads:
                kj, vj = leaf(kb[j]), leaf(vb[j])
                dk_j, dv_j = torch.zeros_like(kj[0, 0]), torch.zeros_like(vj[0, 0])
                for h in range(j * self.group, (j + 1) * self.group):
                    rows, dq_rows = [torch.zeros(0, q.shape[-1], dtype=dtype, device=q.device)], []
                    for start in range(0, n_q, block):  # query blocks: each is exact on its own
                        qh = leaf(qb[h, start:start + block])
                        with torch.set_grad_enabled(grads):
                            if self.fp8 and not upcast:
                                o = attention_fp8_yardstick(qh, kj, vj, causal=self.causal, sm_scale=self.sm_scale,
                                                            window=self.window, q_start=start, seq_len_q=n_q,
                                                            out_e4m3=self.fp8_out)
                            else:
                                o = attention_ref(qh, kj, vj, causal=self.causal, sm_scale=self.sm_scale,
                                                  upcast=upcast, window=self.window, softcap=self.softcap,
                                                  alibi_slopes=self._slope(b, h), q_start=start, seq_len_q=n_q)
                        rows.append(o.detach()[0, 0])
                        if grads:
                            do = dob[h, start:start + block][None, None].to(dtype)
                            gq, gk, gv = torch.autograd.grad(o, (qh, kj, vj), do)
                            dq_rows.append(gq[0, 0])
                            dk_j += gk[0, 0]  # a kv head's gradient sums over query rows and heads
                            dv_j += gv[0, 0]
                    outs[-1].append(torch.cat(rows))
                    dqs[-1].append(torch.cat([rows[0], *dq_rows]))
                dks[-1].append(dk_j)
                dvs[-1].append(dv_j)

        def shaped(parts: list[list[torch.Tensor]]) -> torch.Tensor:
            if self.packed:  # -> (total rows, checked heads, D)
                return torch.cat([torch.stack(heads, dim=1) for heads in parts], dim=0)
            return torch.stack([torch.stack(heads) for heads in parts])  # -> (batches, heads, N, D)

        if not grads:
            return shaped(outs), None
        return shaped(outs), (shaped(dqs), shaped(dks), shaped(dvs))
