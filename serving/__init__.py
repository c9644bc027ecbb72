"""The inference side: engines behind one contract, the serving workers and their loaders, the router and the tier.

`contract` says what an engine is and `rules` what every engine decides alike; `native` and `sglang` are the
engines; `worker`/`handle` run one per device and talk in `messages`; `tier.ServingTier` is what the service holds.
"""
