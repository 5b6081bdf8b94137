"""cpsim from Python: its torch.distributed backend (cpsim.torch)."""
