"""Model families, one module each: how a family's models load, encode images and prompts, predict, compile,
sample, cache and describe themselves. A family is a plain class with the methods of `sd.SD` (no base class;
`sdxl` and `flux` reuse sd's module functions where they share the work). The components a family loads carry
the neutral names `denoiser`, `autoencoder`, `text_encoders` and `tokenizers`."""
