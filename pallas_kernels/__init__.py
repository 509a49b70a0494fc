"""Ragged paged attention: one signature, several bodies (`reference` is the pure-JAX one)."""

from pallas_kernels.reference import ragged_paged_attention as reference_ragged_paged_attention

__all__ = ["reference_ragged_paged_attention"]
