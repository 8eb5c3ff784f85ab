"""Parallelism applied from outside the single-device model.

Order (torchtitan's, documented in ``apply.py``): pipeline split -> tensor parallel
-> activation checkpointing -> compile -> data parallel (FSDP2 / HSDP / DDP)."""
