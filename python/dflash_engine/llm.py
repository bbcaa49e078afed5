"""Offline API in vLLM's shape: ``LLM(model=...).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from .config import EngineConfig
from .engine import EngineStats, LLMEngine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

PromptType = str | dict[str, Any]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        speculative_config: dict | str | None = "auto",
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        num_gpu_blocks_override: int | None = None,
        max_num_batched_tokens: int | None = None,
        dtype: str = "auto",
        device: str = "auto",
        seed: int = 0,
        block_size: int = 16,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        max_mixed_graph_tokens: int = 512,
        tune_gemms: bool = False,
        enable_prefix_caching: bool = True,
        batch_invariant: bool | None = None,
        overlap: bool | None = None,
        cpu_weights: str = "auto",
        tensor_parallel_size: int = 1,
        mamba_ssm_cache_dtype: str = "auto",
        distributed_executor_backend: str = "mp",
    ):
        """speculative_config: "auto" (default): DFlash with the shipped draft when `model` is
        the embedded SmolLM2 (on a GPU or the CPU), off for other models; None or "none": off;
        a dict: vLLM's keys
        ({"method": "dflash"} alone means the shipped draft of the embedded model).
        batch_invariant=True: exact CPU GEMMs (a row's bits never depend on its batch, so
        spec-on output equals spec-off exactly); False: plain CPU kernels (fast); None: from
        $VLLM_BATCH_INVARIANT / $DFLASH_BATCH_INVARIANT, default False.
        cpu_weights: the fast CPU mode's GEMM weights, "auto" (default), "none", "bf16" or
        "int4" (EngineConfig.cpu_weights, cpu/weights.py).
        tensor_parallel_size: ranks the target and draft are split over (this process and N-1
        worker processes it starts; `llm.engine.close()` stops them, as does garbage collection).
        distributed_executor_backend: "mp" (default) or "external_launcher" (ranks started by
        torchrun; on ranks >= 1 this call serves rank 0's steps and then exits the process).
        mamba_ssm_cache_dtype: a hybrid target's recurrent-state dtype (EngineConfig)."""
        self.engine = LLMEngine(
            EngineConfig(
                model=model, speculative_config=speculative_config, max_num_seqs=max_num_seqs,
                max_model_len=max_model_len, num_gpu_blocks_override=num_gpu_blocks_override,
                max_num_batched_tokens=max_num_batched_tokens, dtype=dtype, device=device, seed=seed,
                block_size=block_size, gpu_memory_utilization=gpu_memory_utilization,
                enable_prefix_caching=enable_prefix_caching,
                enforce_eager=enforce_eager, max_mixed_graph_tokens=max_mixed_graph_tokens, tune_gemms=tune_gemms,
                batch_invariant=batch_invariant, overlap=overlap,
                cpu_weights=cpu_weights, tensor_parallel_size=tensor_parallel_size,
                mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
                distributed_executor_backend=distributed_executor_backend,
            )
        )
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
        if not isinstance(prompt, str):
            raise TypeError(f"prompts must be strings or dicts, got {type(prompt).__name__}")
        if self.engine.tokenizer is None:
            raise ValueError("this model directory has no tokenizer; pass {'prompt_token_ids': [...]}")
        return prompt, self.engine.tokenizer.encode(prompt)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        one = isinstance(sampling_params, SamplingParams)
        params = [sampling_params] * len(prompts) if one else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        order = []
        try:
            for prompt, p in zip(prompts, params):
                text, ids = self._tokenize(prompt)
                rid = str(next(self._ids))
                self.engine.add_request(rid, ids, p, prompt=text, final_only=True)
                order.append(rid)
        except Exception:
            for rid in order:  # all or nothing: no half-submitted batch lingers in the engine
                self.engine.abort_request(rid)
            raise
        return self._run(order, use_tqdm and len(order) > 1)

    def _run(self, order: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
        return [done[r] for r in order]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}
            for text in (tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt) for c in conversations)
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def stats(self) -> EngineStats:
        """Acceptance statistics: drafts, draft tokens, accepted tokens, per position, τ."""
        return self.engine.stats()
