"""Which of a family's transformer layers get the LoRA (``LoraTargets``, a base of ``FlowAdapter``).

``model.lora_targets`` lists module-name suffixes; empty (the default) means the family's own,
its adapter's ``default_lora_targets`` (each family's list sits on its adapter class, beside the
transformer it names). ``lora_targets`` turns suffixes into the transformer's full linear-layer
names, leaving out the layers that cannot change the prediction (``dead_lora_targets``) and, for a
model with two experts (Wan2.2), keeping one expert's (``expert_targets``).
"""

from __future__ import annotations

import torch


class LoraTargets:
    """The LoRA-target part of a ``FlowAdapter`` (it reads ``self.transformer`` and ``self.family``)."""

    default_lora_targets: tuple[str, ...] = ()  # the family's suffixes where model.lora_targets is empty

    @classmethod
    def lora_suffixes(cls, configured) -> list[str]:
        """The suffixes a config's ``model.lora_targets`` means: as listed, or where it is empty the
        family's ``default_lora_targets``."""
        return list(configured) or list(cls.default_lora_targets)

    def dead_lora_targets(self) -> set[str]:
        """Linear layers whose output cannot change the prediction (exact-zero gradient): left out."""
        return set()

    def lora_targets(self, suffixes: list[str], experts: str = "both") -> list[str]:
        """Full module names of the transformer's linear layers that end with one of ``suffixes`` (the
        family's default where empty: ``lora_suffixes``), of one expert only where ``experts`` names it
        (``expert_targets``)."""
        from diffusionrl.config import ConfigError

        suffixes = self.lora_suffixes(suffixes)
        dead = self.dead_lora_targets()
        names = [
            name
            for name, module in self.transformer.named_modules()
            if isinstance(module, torch.nn.Linear) and any(name.endswith(s) for s in suffixes) and name not in dead
        ]
        if experts != "both":
            names = self.expert_targets(names, experts)
        if not names:
            raise ConfigError(f"model.lora_targets={suffixes}: no linear layer of the {self.family} transformer "
                              f"ends with one of them; list suffixes of its layers, or leave it empty for the "
                              f"family's own ({list(self.default_lora_targets)})")
        return names

    def expert_targets(self, names: list[str], experts: str) -> list[str]:
        """The LoRA target ``names`` of expert ``experts`` (a family with several experts: Wan2.2)."""
        from diffusionrl.config import ConfigError

        raise ConfigError(f"model.lora_experts={experts}: {self.family} has one transformer, not two experts "
                          "(Wan2.2); set model.lora_experts=both")
