"""Training sessions: a tenant's LoRA model held resident by a session worker process, driven request by request
(forward_backward, optim_step, save_state, save_weights_for_sampler), every request answered by a future."""
