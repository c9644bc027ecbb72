"""Triton multi-LoRA kernels: segmented shrink and expand over a per-token adapter slot index.

Twins of `inkwell.kernels.torch_ops` (same signatures, same results up to summation order), plus
sliced variants for fused projections (q/k/v/r, gate/up) and a fused shrink+expand for decode.
`dense` holds the dense projections' ops and `expert` the routed experts'; both launch the kernels of
`shrink` and `expand`, and `common` holds what they all share. `inkwell.kernels.dispatch` imports them
when the first CUDA tensor arrives.

Every kernel gives one program a tile of BLOCK_T consecutive tokens and one slot: it masks the tile
down to that slot's tokens (and for routed experts walks the experts those tokens went to), so mixed
adapters, base-model tokens (slot -1) and slots absent from the batch need no sort, no host sync and
a grid that depends only on shapes, which keeps every launch CUDA-graph capturable. Programs of
absent slots exit after reading BLOCK_T slot ids.

Slot buffers are zero-padded to the largest rank, so per-slot ranks need no rank table. A sliced
projection keeps A stacked along the rank ([S, P*R, K]) and B stacked along the output ([S, N, R]);
output column n belongs to slice p(n) and reads rank block p(n) of the stacked shrink result: the
expand multiplies by a block-diagonal B it never materializes.
"""
