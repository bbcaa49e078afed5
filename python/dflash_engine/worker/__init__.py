"""The worker: runs step plans on the device (model runner, the one step function, its
CUDA-graph runner, the KV cache and its sizing, the in-flight step, the step timer)."""
