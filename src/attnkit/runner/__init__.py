"""The comparison runner behind ``attnkit compare``: same model, same seeds and budget, several mechanisms.

    from attnkit.runner import build_config, run_compare
    result = run_compare(build_config({"task": "reuters8", "mechanisms": "softmax,dnas", "seeds": 2}))
    result.records   # one record per mechanism: mean/std metrics, step time ratio, explain-away, hybrid u
"""

from .compare import CompareResult, aggregate, run_compare
from .config import PRESETS, CompareConfig, build_config, load_config_file
from .tasks import ClassificationTask, Seq2SeqTask, get_task
from .train import RunResult, train_run

__all__ = [
    "CompareConfig",
    "PRESETS",
    "build_config",
    "load_config_file",
    "CompareResult",
    "run_compare",
    "aggregate",
    "ClassificationTask",
    "Seq2SeqTask",
    "get_task",
    "RunResult",
    "train_run",
]
