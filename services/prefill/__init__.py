"""prefill worker: the engine in the `prefill` role (services.engine, role="prefill").

Not built yet as a process: issue [F1]. The engine side exists: LLMEngine.export_kv / release.
"""
