"""The quality gate (`kvfleet eval quality`): a candidate model scored against a reference.

    dataset.py      the eval set (bundled: eval_set.jsonl, package data) and its version
    scorer.py       Scorer: EngineScorer (a local checkpoint, in-process) and HttpScorer (any
                    OpenAI-compatible server)
    gate.py         the metrics, QualityThresholds, QualityReport, add_quality_args / run_quality
"""
