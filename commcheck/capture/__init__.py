"""Rank side: wrappers around torch.distributed collectives and the records they produce."""
