"""The persistent MoE decode megakernel (issue: megakernel)."""
