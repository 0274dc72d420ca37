"""The layer above training and evaluation: jobs that need both (τ measured during training, eval after
training). train/ reaches this code only through config (``_target_`` strings instantiated at run time), so
train/ never imports eval/ and eval/ never imports train/."""
