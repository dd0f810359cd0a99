"""gateway: the fleet's front door (DESIGN.md section 3, step 1). `python -m services.gateway`.

OpenAI-compatible REST (`app.py`) and the kvfleet.v1 Gateway gRPC API (`grpc_api.py`) over one core
(`core.py`): API key -> tenant and class (`auth.py`, `config.py`), strict validation and
tokenization with the model's tokenizer (`openai_schema.py`, `validation.py`), tenant quotas in
Redis (`quota.py`); per request a router's Admit, then the calls to the workers its plan names,
streamed to the client (`fleet_run.py`) and cancelled when the client goes away. The workers send
token ids; the text is made here (`output_processor.py`: detokenizing, stop strings).
"""
