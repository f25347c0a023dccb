"""Training objectives: what noise and timesteps a step draws (from the run's generator), what the model must
predict, and the loss weights. `ddpm.DDPM` (SD1.x/2.x, SDXL) and `flow_matching.FlowMatching` (FLUX.1) have the
same methods; a model family names its objective (library.families)."""
