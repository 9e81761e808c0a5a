"""Configuration: the schema (:mod:`~flashrun.config.schema`) and how files, flags and ``--set``
become one validated :class:`Config` (:mod:`~flashrun.config.load`). Cheap to import: no torch."""

from flashrun.config.load import (
    base_url_root,
    find_config,
    key_variable,
    load_config,
    parse_set,
    resolve_api_key,
)
from flashrun.config.schema import (
    DEFAULT_CONFIG,
    SECTIONS,
    BenchConfig,
    ClusterConfig,
    Config,
    Dtype,
    ExperimentConfig,
    HeadDim,
    PositiveInt,
)

__all__ = ["DEFAULT_CONFIG", "SECTIONS", "BenchConfig", "ClusterConfig", "Config", "Dtype", "ExperimentConfig", "HeadDim",
           "PositiveInt", "base_url_root", "find_config", "key_variable", "load_config", "parse_set",
           "resolve_api_key"]
