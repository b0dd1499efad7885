"""Mixture-of-Experts modules on EPBuffer: MoELayer, router, experts, runner, rows autograd."""
