"""The session benchmark (`trtllm-mtp-carry bench`): replay multi-turn sessions under
each drafter policy in lockstep and compare warm time to first token, drafter
preparation and acceptance side by side, as medians with p25-p75 and as
paired per-turn ratios (`stats.py`), over replays after a warm-up.

Modules: `sessions` (what is replayed); `driver` (the drivers' interface, the
records they return, the remote lockstep schedule) and one driver per target:
`replay` (in process), `triton_driver` (a Triton server, `--server`),
`openai_driver` (Dynamo's OpenAI API, `--openai`); `report` (summaries,
tables, plot), `stats` (quantiles, paired ratios), `options` (flag checks
shared with `chat`), `main` (the command). Serving never imports the bench.
"""
