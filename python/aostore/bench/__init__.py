"""Benchmark code, kept out of the runtime modules: the RL-rollout replay behind
``python -m aostore`` (``replay``: W3's schedule; ``contenders``: the stores compared;
``measure``: the replay and its figures; ``report``: the main job's table and judging) and the
pure-Python stores that benchmarks and tests measure against (``baseline``: a replica of vLLM's
store and the store that rescans; ``baseline_variable``: a variable-size store of the same
contract). No runtime module imports this package; the command line (``aostore.__main__``) and
``benches/`` do."""
