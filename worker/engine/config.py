"""EngineConfig: the engine's one frozen, validated settings record."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from worker.engine.linear import can_bf16_prefill

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    target_path: str  # Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer.json)
    draft_path: str | None = None  # same-tokenizer draft model; None = no speculation
    device: str = "cpu"  # "cpu", "cuda", "cuda:1", ...
    dtype: str = "float32"  # float32 | bfloat16 | float16
    kv_budget_bytes: int = 256 * 1024 * 1024  # target KV pool + draft KV pool (same block count)
    block_size: int = 16  # tokens per KV block
    max_running: int = 64  # sequences decoded together at most
    max_batched_tokens: int = 512  # tokens fed to the target per step (prefill chunks + decodes)
    max_model_len: int | None = None  # prompt + completion cap; None = the model's max positions
    # prompt rows' matmuls on the CPU: "bfloat16" runs them on a bf16 copy of the target's weights (AMX),
    # ~3x cheaper prompts; bf16 rounding moves their logits off transformers' fp32 (worker/engine/linear.py)
    prefill_dtype: str = "float32"
    gamma_max: int = 6  # largest speculation depth a policy may ask for
    default_gamma: int = 0  # γ used until set_gamma_policy is called (clamped to 0 without a draft)
    watermark: float = 0.01  # share of KV blocks kept free at admission, so running work can grow
    acceptance_alarm_window: int = 50  # speculative steps per acceptance-health window
    acceptance_alarm_floor: float = 0.05  # alarm when a window's mean acceptance falls below this ...
    acceptance_alarm_healthy: float = 0.3  # ... after an earlier window was at least this
    num_threads: int | None = None  # torch CPU threads; None = leave torch's default
    # elastic memory (worker/engine/budget.py): the whole device budget = weights + KV pools + workspace;
    # when set, it sizes the KV pools (kv_budget_bytes is then ignored); None = weights + kv_budget_bytes + workspace
    memory_budget_bytes: int | None = None
    workspace_bytes: int | None = None  # activation reserve kept out of the KV pools; None = estimated

    def __post_init__(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"EngineConfig.{field}: {why}")

        if not (Path(self.target_path) / "config.json").is_file():
            raise bad("target_path", f"{self.target_path!r} has no config.json; pass a Hugging Face checkpoint folder")
        if self.draft_path is not None and not (Path(self.draft_path) / "config.json").is_file():
            raise bad("draft_path", f"{self.draft_path!r} has no config.json; pass a checkpoint folder or None")
        if self.dtype not in DTYPES:
            raise bad("dtype", f"{self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.prefill_dtype not in ("float32", "bfloat16"):
            raise bad("prefill_dtype", f"{self.prefill_dtype!r} is not float32 or bfloat16")
        if self.prefill_dtype == "bfloat16" and not can_bf16_prefill(self.device, self.dtype):
            raise bad("prefill_dtype", "bfloat16 prefill is a CPU float32 engine's option, and needs oneDNN's native "
                      "bf16 path (AMX or AVX512-BF16); this engine or CPU has neither")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise bad("device", f"{self.device!r}: use 'cpu' or 'cuda[:N]'")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise bad("device", f"{self.device!r} requested but torch sees no CUDA device; use 'cpu'")
        if self.kv_budget_bytes <= 0:
            raise bad("kv_budget_bytes", "must be > 0")
        if not 1 <= self.block_size <= 1024:
            raise bad("block_size", "must be in [1, 1024]")
        if self.max_running < 1:
            raise bad("max_running", "must be >= 1")
        if self.max_batched_tokens < self.max_running * (self.gamma_max + 1):
            raise bad("max_batched_tokens", f"must be >= max_running * (gamma_max + 1) = "
                      f"{self.max_running * (self.gamma_max + 1)} so a full speculative decode step fits")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise bad("max_model_len", "must be >= 2 or None")
        if not 0 <= self.gamma_max <= 16:
            raise bad("gamma_max", "must be in [0, 16]")
        if not 0 <= self.default_gamma <= self.gamma_max:
            raise bad("default_gamma", f"must be in [0, gamma_max={self.gamma_max}]")
        if not 0.0 <= self.watermark < 0.5:
            raise bad("watermark", "must be in [0, 0.5)")
        if self.acceptance_alarm_window < 1:
            raise bad("acceptance_alarm_window", "must be >= 1")
        if self.num_threads is not None and self.num_threads < 1:
            raise bad("num_threads", "must be >= 1 or None")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise bad("memory_budget_bytes", "must be > 0 bytes or None")
        if self.workspace_bytes is not None and self.workspace_bytes < 0:
            raise bad("workspace_bytes", "must be >= 0 bytes or None (estimated)")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
