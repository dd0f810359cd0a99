"""decode worker: the engine in the `decode` role (services.engine, role="decode").

Not built yet as a process: issue [F1]. The engine side exists: LLMEngine.reserve_remote /
import_kv.
"""
