from __future__ import annotations

import pytest

from poise.config import EngineConfig, SchedulerConfig


def test_aliases_map_to_vllm_names() -> None:
    cfg = EngineConfig.from_kwargs(
        max_requests_per_batch=16,
        max_batch_tokens=4096,
        max_memory_percent=0.85,
        scheduling_policy="prefill-first",
    )
    assert cfg.scheduler.max_num_seqs == 16
    assert cfg.scheduler.max_num_batched_tokens == 4096
    assert cfg.cache.gpu_memory_utilization == 0.85
    assert cfg.scheduler.scheduling_policy == "prefill_first"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
        ({"block_size": 12}, "block_size"),
        ({"safety_margin": 1.5}, "safety_margin"),
        ({"dtype": "int3"}, "dtype"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_kwargs(**kwargs)


def test_configs_are_frozen() -> None:
    cfg = SchedulerConfig()
    with pytest.raises(AttributeError):
        cfg.max_num_seqs = 3  # type: ignore[misc]


def test_transformers_scheduler_type_is_an_alias() -> None:
    # transformers' ContinuousBatchingConfig spells the policy ``scheduler_type``.
    cfg = EngineConfig.from_kwargs(scheduler_type="prefill_first", max_memory_percent=0.8)
    assert cfg.scheduler.scheduling_policy == "prefill_first"
    assert cfg.cache.gpu_memory_utilization == 0.8
    assert EngineConfig.from_kwargs(scheduler_type="fcfs").scheduler.scheduling_policy == "fifo"
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig.from_kwargs(scheduler_type="lifo")
