"""GPU smoke run (device machine): the reference path on CUDA agrees with itself spec on/off
and with the CPU run, in float32; reports wall time. Not a unit test (CI has no GPU).

Usage: python bench/gpu_smoke.py
"""

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tiny_models import make_tiny_dflash_draft, make_tiny_qwen3  # noqa: E402

from dflash_engine import LLM, SamplingParams  # noqa: E402


def run(model, draft, device, dtype, prompts, params):
    spec = {"method": "dflash", "model": str(draft)} if draft else None
    llm = LLM(model=str(model), device=device, dtype=dtype, speculative_config=spec, max_num_seqs=64,
              num_gpu_blocks_override=4096)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if device == "cuda":
        torch.cuda.synchronize()
    return [o.outputs[0].token_ids for o in outs], time.perf_counter() - t0, llm.stats()


def main() -> None:
    print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
    tmp = Path(tempfile.mkdtemp())
    model = make_tiny_qwen3(tmp / "q")
    draft = make_tiny_dflash_draft(tmp / "d", model, num_layers=1, block_size=4, target_layer_ids=[1, 2])
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 250, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()}
               for _ in range(32)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    cpu, t_cpu, _ = run(model, None, "cpu", "float32", prompts, params)
    for dtype in ("float32", "bfloat16"):
        off, t_off, _ = run(model, None, "cuda", dtype, prompts, params)
        on, t_on, st = run(model, draft, "cuda", dtype, prompts, params)
        same_spec = sum(a == b for a, b in zip(off, on))
        same_cpu = sum(a == b for a, b in zip(off, cpu))
        print(f"{dtype}: spec-on == spec-off for {same_spec}/32 requests; cuda == cpu for {same_cpu}/32; "
              f"time off {t_off:.2f}s on {t_on:.2f}s (cpu {t_cpu:.2f}s); drafts {st.spec_num_drafts}")

    # A draft trained against a learnable tiny target: acceptance on CUDA vs CPU.
    from draft_training import make_learnable_target, random_prompts, train_tiny_draft

    target = make_learnable_target(tmp / "lt")
    trained = train_tiny_draft(target, tmp / "td", block_size=4)
    ps = [{"prompt_token_ids": p} for p in random_prompts(32, 8, seed=4321).tolist()]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref, _, _ = run(target, None, "cpu", "float32", ps, params)
    for device in ("cpu", "cuda"):
        for conc in (1, 32):
            spec = {"method": "dflash", "model": str(trained)}
            llm = LLM(model=str(target), device=device, dtype="float32", speculative_config=spec,
                      max_num_seqs=conc, num_gpu_blocks_override=4096)
            outs = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
            st = llm.stats()
            print(f"trained draft on {device} c={conc}: tau {st.mean_acceptance_length:.4f} "
                  f"(drafts {st.spec_num_drafts}, accepted {st.spec_num_accepted_tokens}); "
                  f"== cpu spec-off for {sum(a == b for a, b in zip(outs, ref))}/32")


if __name__ == "__main__":
    main()
