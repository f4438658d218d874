"""The analytic roofline model of the resource-utility curves: model.py (a model shape and a
device preset -> curves), tp.py (one rank of a tensor-parallel group: its share plus the
collectives)."""
