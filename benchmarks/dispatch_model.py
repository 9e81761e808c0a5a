"""A model of how a causal grid's programs land on the SMs (NOTES v18): programs start in grid
order whenever a slot frees (greedy list scheduling), a program's cost is its key blocks plus a
fixed overhead, and the makespan is compared with an even load. It ignores L2 entirely, which is
what the H200 measurements (benchmarks/tile_order_ab.py) add.

    python benchmarks/dispatch_model.py   # no GPU needed
"""

import heapq

# (name, heads over the batch, query tiles per head, program slots: SMs x programs per SM)
GRIDS = (
    ("qwen2-1b prefill, Gluon forward", 4 * 12, 2048 // 128, 132),
    ("llama-1b prefill, portable forward", 4 * 32, 2048 // 64, 3 * 132),
    ("1 x 16 heads x 2048, Gluon forward", 16, 2048 // 128, 132),
    ("32 x 16 heads x 1024", 32 * 16, 1024 // 128, 132),
)
OVERHEAD = 1.0  # a program's prologue and epilogue, in key blocks


def makespan(costs: list[int], slots: int) -> float:
    free = [0.0] * slots
    for cost in costs:
        heapq.heappush(free, heapq.heappop(free) + cost + OVERHEAD)
    return max(free)


def main() -> None:
    for name, heads, blocks, slots in GRIDS:
        # rank r: the tile with the r-th most key blocks (blocks - r of them)
        head_by_head = [blocks - r for _ in range(heads) for r in range(blocks)]
        across = [blocks - r for r in range(blocks) for _ in range(heads)]
        even = sum(c + OVERHEAD for c in head_by_head) / slots
        print(f"{name:36s} head by head {makespan(head_by_head, slots) / even:.3f}  "
              f"across the heads {makespan(across, slots) / even:.3f}  (of an even load)")


if __name__ == "__main__":
    main()
