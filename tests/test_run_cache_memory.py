"""Run setup's caching step gives the GPU memory the VAE and the text encoders held back to the device (PyTorch's
caching allocator keeps it otherwise: run72 saw SD3.5's nvidia-smi figure stay 4.7 GiB above upstream's in the loop)."""
from types import SimpleNamespace

import torch

from library.run import setup


def _run_cache(monkeypatch, device):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    args = SimpleNamespace(cache_latents=False, cache_latents_to_disk=False, cache_text_encoder_outputs=False,
                           cache_text_encoder_outputs_to_disk=False)
    trainer = SimpleNamespace(family=None)
    components = SimpleNamespace(autoencoder=None, text_encoders=[])
    cached = setup.cache(trainer, args, SimpleNamespace(device=torch.device(device)), components, [], torch.float32)
    return cached, calls


def test_caching_returns_the_gpu_memory_it_used(monkeypatch):
    assert _run_cache(monkeypatch, "cuda") == (False, [1])


def test_caching_on_the_cpu_leaves_the_cuda_allocator_alone(monkeypatch):
    assert _run_cache(monkeypatch, "cpu") == (False, [])
