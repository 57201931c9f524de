"""Which layers get guidance: `deep:K`, `all`, an explicit list, or a byte budget per token."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerPolicy:
    """A parsed layer policy.

    Spellings: "all"; "deep:K" (the last K layers, the source's scheme); "layers:0,5,7" or
    "0,5,7" (an explicit list); "budget:B" (the layers with the highest measured flip rates
    whose guidance fits B bytes per token); "none".
    """

    kind: str
    layers: tuple[int, ...] = ()
    k: int = 0
    budget_bytes_per_token: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> LayerPolicy:
        spec = spec.strip()
        try:
            if spec in ("all", "none"):
                return cls(spec)
            if spec.startswith("deep:"):
                k = int(spec[5:])
                if k < 0:
                    raise ValueError
                return cls("deep", k=k)
            if spec.startswith("budget:"):
                b = float(spec[7:])
                if b < 0:
                    raise ValueError
                return cls("budget", budget_bytes_per_token=b)
            body = spec.removeprefix("layers:")
            layers = tuple(sorted({int(v) for v in body.split(",") if v.strip()}))
            if not layers or min(layers) < 0:
                raise ValueError
            return cls("list", layers=layers)
        except ValueError:
            raise ValueError(
                f"bad guidance layer policy {spec!r}: use 'all', 'none', 'deep:K', 'layers:i,j,...' "
                "or 'budget:<bytes per token>'") from None

    def select(self, num_layers: int, flip_rate: dict[int, float] | None = None,
               bytes_per_token: dict[int, float] | None = None) -> list[int]:
        """The guided layers of a model with `num_layers` layers, ascending.

        `budget` needs each layer's measured flip rate and guidance bytes per token; it takes
        layers in decreasing flip rate while they fit the budget.
        """
        if self.kind == "all":
            return list(range(num_layers))
        if self.kind == "none":
            return []
        if self.kind == "deep":
            return list(range(max(0, num_layers - self.k), num_layers))
        if self.kind == "list":
            bad = [i for i in self.layers if i >= num_layers]
            if bad:
                raise ValueError(f"guidance policy names layers {bad} but the model has {num_layers}")
            return list(self.layers)
        missing = [i for i in range(num_layers) if flip_rate is None or i not in flip_rate
                   or bytes_per_token is None or i not in bytes_per_token]
        if missing:
            raise ValueError(f"budget policy needs a measured flip rate and bytes per token for every layer; "
                             f"missing for layers {missing}")
        chosen, spent = [], 0.0
        for layer in sorted(range(num_layers), key=lambda i: -flip_rate[i]):
            if spent + bytes_per_token[layer] <= self.budget_bytes_per_token:
                chosen.append(layer)
                spent += bytes_per_token[layer]
        return sorted(chosen)
