"""Training targets: what is trained and how it is saved. `lora.LoRA` trains a network module (networks.lora ...)
on a frozen model; `full.Full` trains the model's own weights (DreamBooth, fine-tune). Both have the same
methods; a target is given the family (library.families) where it needs the models' parts."""
