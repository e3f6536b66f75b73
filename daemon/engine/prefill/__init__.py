"""Prefill: a prompt into the caches in resumable pieces, several at once, or riding a decode step."""
