"""TensorRT-LLM behind Triton (deployment): the Python-backend model, its serving glue, the repository writer.

- `model`: `TritonPythonModel`, one `tensorrt_llm.LLM` per model instance with the
  carry attached in process, sessions and metrics as the reference model has them;
- `serving`: the model's options, chat template and response shaping;
- `repo`: the `triton-repo --engine trtllm` repository writer.

This layer sits on the executor-level adapter (`trtllm_mtp_carry.trtllm`) and on the
shared Triton front end (`serve.triton`), using only their public names; the adapter
depends on nothing here. Importing it loads no torch and no tensorrt_llm.
"""
