"""The quality gate (`kvfleet eval quality`): a candidate model scored against a reference.

    dataset.py      the eval sets (package data): eval_set.jsonl (completion items, the tiny
                    model's), smollm2_eval.jsonl (chat items for SmolLM2-135M-Instruct, gated with
                    smollm2_thresholds.yaml), and their versions
    scorer.py       Scorer: EngineScorer (a local checkpoint, in-process) and HttpScorer (any
                    OpenAI-compatible server)
    gate.py         the metrics, QualityThresholds, QualityReport, add_quality_args / run_quality
    variants.py     candidates the gate must tell apart: perturbed, truncated, cast copies of a dir
"""
