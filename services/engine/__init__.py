"""The engine: LLMEngine (engine.py) over the scheduler, the paged KV block pool and the model
executor, plus its config, sampling, detokenizing and the simulated engine core (sim_engine.py)."""
