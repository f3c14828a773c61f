"""Reading a peer's self-description: vLLM's config-info gauges, SGLang's and TGI's endpoints."""

from __future__ import annotations

from poise.bench.server_info import from_metrics, from_poise, from_sglang, from_tgi

VLLM = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",gpu_memory_utilization="0.9",num_gpu_blocks="2048"} 1.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 0.0
"""


def test_vllm_config_info_gauge_labels_become_server_args() -> None:
    info = from_metrics(VLLM)
    assert info is not None and info.source == "metrics *config_info"
    assert info.server_args["num_gpu_blocks"] == "2048" and info.server_args["block_size"] == "16"
    assert from_metrics("# TYPE x gauge\nx 1\n") is None


def test_sglang_and_tgi_endpoints() -> None:
    sg = from_sglang(
        {
            "model_path": "q",
            "tp_size": 1,
            "chunked_prefill_size": 8192,
            "version": "0.5.0",
            "internal_states": [{}],
        }
    )
    assert sg is not None and sg.version == "0.5.0"
    assert sg.server_args == {"model_path": "q", "tp_size": 1, "chunked_prefill_size": 8192}
    tgi = from_tgi(
        {
            "model_id": "m",
            "model_dtype": "torch.float16",
            "version": "3.0.0",
            "max_batch_prefill_tokens": 4096,
        }
    )
    assert tgi is not None and tgi.version == "3.0.0"
    assert tgi.server_args["max_batch_prefill_tokens"] == 4096 and tgi.gpu is None
    assert from_tgi({"version": "x"}) is None and from_sglang({"model_id": "m"}) is None


def test_poise_effective_values_replace_configured_ones() -> None:
    data = {
        "engine": "poise",
        "version": "0.1.0",
        "dtype": "bfloat16",
        "device": "cpu",
        "engine_config": {"dtype": "auto", "max_num_seqs": 8},
        "hardware": {"summary": "cpu: X (2 cores)"},
    }
    info = from_poise(data)
    assert info is not None and info.gpu == "cpu: X (2 cores)"
    assert info.server_args == {"dtype": "bfloat16", "max_num_seqs": 8, "device": "cpu"}
    assert from_poise({"engine": "vllm"}) is None
