"""Decoders: sampling and constraints, serial and speculative decode, the continuous batch, exactness."""
