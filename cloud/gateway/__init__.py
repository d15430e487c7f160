"""The public gRPC service (``service.SpeculativeService``): admission, Start checks, one module
per session mode's loop (``lockstep``, ``cloud_led``, ``cloud_only``) driving a ``round.Round``,
and the Triton client it verifies through. No torch: the gateway process never loads the model.
"""
