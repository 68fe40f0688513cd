// Carries the precompiled <torch/torch.h> that every libtorch translation unit reuses
// (target_precompile_headers REUSE_FROM spillway_torch_pch): parsing torch.h is most of their
// compile time.
