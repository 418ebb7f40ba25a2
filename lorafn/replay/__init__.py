"""`lorafn bench replay`: real arrivals (Azure LLM inference traces) over N functions, through the real
HTTP API of a running platform, with ablations, cost and plots (docs/replay.md).

- `trace`: loading the traces and GSM8K prompts, the mapping onto functions, scaling (pure).
- `stats`: percentiles, SLO violations, GPU-seconds, cost, paths (pure).
- `paper`: ServerlessLoRA's own figures, for the side-by-side comparison (pure data).
- `configs`: the ablations as platform settings (pure).
- `driver`: the open-loop HTTP client and the Redis sampler (asyncio).
- `platform`: starting `lorafn up` with one configuration, registering the functions.
- `report`, `plots`: the terminal table, the JSON file, the PNG plots.
- `cli`: the `lorafn bench` sub-app.
"""
