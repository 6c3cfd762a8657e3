"""What is removed, as a registry like operator kinds and criteria: whole layers, sub-blocks, or both chosen together.

A unit says which criteria can choose it, which options it needs, which candidates it chooses among and what
statistics of the dense model its choice and first fit read (what `calibrate` collects ahead, into shards too).
`ghost_prune`, `calibrate` and the options follow it: nothing branches on a unit's name.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

from transformers import PretrainedConfig

from ..architectures import language_config, removal_problem
from ..errors import GhostedError
from ..remote.format_ghosted import expected_boundaries
from ..statistics import StatisticsPlan
from ..utils.registry import Registry
from . import subblocks
from .operators import operator_kind
from .selection import CRITERIA, ContiguousCriterion, SelectionRequest, criterion


class Unit:
    """A unit of removal: its option rules (`check`) and the statistics it needs (`statistics`)."""

    name: ClassVar[str]
    help: ClassVar[str]
    whole_layers: ClassVar[bool]  # whole decoder layers are removed, each boundary recovered by an operator
    subblocks: ClassVar[bool]  # attention and MLP sub-blocks are replaced, each by a map of what it read
    criteria: ClassVar[tuple[str, ...] | None] = None  # the criteria that can choose it (None: every one)

    def check(self, options: Any) -> None:
        """Refuse options this unit cannot serve (`PruneOptions.check` asks, so the API and the CLI refuse alike)."""
        if self.criteria is not None and options.criterion not in self.criteria:
            raise GhostedError(f"unit={self.name!r} chooses by criterion {' or '.join(self.criteria)}, not "
                               f"{options.criterion!r}.")

    def statistics(self, config: PretrainedConfig, options: Any) -> StatisticsPlan:
        """What of the dense model these options can need, known before anything is chosen."""
        raise NotImplementedError


UNITS: Registry[Unit] = Registry("unit")
unit = UNITS.lookup


@UNITS.register
class Layers(Unit):
    """Whole decoder layers: any criterion chooses them, any operator kind recovers each boundary."""

    name = "layer"
    help = "whole decoder layers, each boundary recovered by an operator"
    whole_layers, subblocks = True, False

    def check(self, options: Any) -> None:
        if CRITERIA[options.criterion].takes_layers and not options.layers:
            raise GhostedError(f"criterion {options.criterion!r} needs the layer indices to remove (layers=[...]).")
        if options.subblocks:
            raise GhostedError("subblocks=[...] is only used with unit='subblock' or 'mixed' (and criterion='manual').")
        if str(options.map_rank) != "full":
            raise GhostedError("map_rank sets the rank of sub-blocks' maps: use it with unit='subblock' or 'mixed' (a "
                               "whole layer's boundary operator is full).")
        if options.joint_rounds != 1:
            raise GhostedError("joint_rounds sets how the sub-block choice meets its budget: use it with "
                               "unit='subblock' or 'mixed'.")

    def statistics(self, config: PretrainedConfig, options: Any) -> StatisticsPlan:
        """The criterion's statistics and the fit statistics of every boundary it may choose. ShortGPT's scattered
        layers and sequential fits of later boundaries need passes on the chosen layers (pass calibration text then)."""
        chosen, kind = criterion(options.criterion), operator_kind(options.operator)
        request, depth = selection_request(config, options), language_config(config).num_hidden_layers
        if isinstance(chosen, ContiguousCriterion):
            spans = chosen.spans(request)
        elif chosen.takes_layers:
            spans = boundary_spans(depth, sorted(options.layers))
        else:
            spans = []
        return StatisticsPlan.union([chosen.statistics(request), *(kind.statistics(s, e) for s, e in spans)])


@UNITS.register
class SubBlocks(Unit):
    """Attention and MLP sub-blocks, chosen by their measured damage (or given), each map fitted down the network."""

    name = "subblock"
    help = "attention and MLP sub-blocks, each replaced by a closed-form linear map of the input it read"
    whole_layers, subblocks = False, True
    criteria = ("ghost-aware", "manual")  # the measured damage of each fitted replacement; the given list

    def candidates(self, depth: int) -> list[subblocks.SubBlockRef]:
        """Everything this unit chooses among, in network order."""
        return subblocks.all_subblocks(depth, whole_layers=self.whole_layers)

    def check(self, options: Any) -> None:
        super().check(options)
        unit, manual = f"unit={self.name!r}", CRITERIA[options.criterion].takes_layers
        if options.layers and not self.whole_layers:
            raise GhostedError("layers=[...] names whole layers; with unit='subblock' pass subblocks=[...] (or use "
                               "unit='mixed' for both).")
        if options.subblocks and not manual:
            raise GhostedError(f"subblocks=[...] names what to replace, which criterion {options.criterion!r} chooses "
                               "itself: pass criterion='manual' with them, or leave them out.")
        if manual and not (options.subblocks or options.layers):
            raise GhostedError(f"{unit} with criterion 'manual' needs what to replace (subblocks=['12.attention', "
                               "...]" + (", layers=[...]" if self.whole_layers else "") + ").")
        if manual and options.joint_rounds != 1:
            raise GhostedError("joint_rounds sets how criterion 'ghost-aware' meets the budget; with criterion "
                               "'manual' the list given is replaced: leave joint_rounds at 1.")
        if not manual and not options.budgeted:
            raise GhostedError(f"{unit} removes a budget: pass remove='25%', num_parameters or remove_kv='50%'.")
        subblocks.parse_map_rank(options.map_rank)
        if options.operator != "ghost" or options.fitting != "sequential":
            raise GhostedError(f"{unit} fits each map sequentially down the network (a whole layer's map is its "
                               "boundary's operator): leave operator and fitting at their defaults.")

    def statistics(self, config: PretrainedConfig, options: Any) -> StatisticsPlan:
        """Every candidate's fit statistics (the choice fits each on the dense model); with the given list, the
        first one's (the first sequential fit is on the dense model, every later one on the model patched so far)."""
        depth = language_config(config).num_hidden_layers
        if CRITERIA[options.criterion].takes_layers:
            chosen = subblocks.validate_subblocks(options.subblocks or [], depth, options.layers or [])
            ref, end = subblocks.sequential_steps(depth, chosen)[0]
            return subblocks.candidate_statistics(ref, end)
        return StatisticsPlan.union(subblocks.candidate_statistics(ref) for ref in self.candidates(depth))


@UNITS.register
class Mixed(SubBlocks):
    """Sub-blocks and whole layers as candidates of one choice; a run of removed layers is one ghost boundary."""

    name = "mixed"
    help = "both chosen together (a whole layer is one more candidate, its map the boundary's operator)"
    whole_layers, subblocks = True, True


def selection_request(config: PretrainedConfig, options: Any) -> SelectionRequest:
    """What the criterion is asked to choose, for a model of this config."""
    config = language_config(config)
    return SelectionRequest(depth=config.num_hidden_layers, num_layers=options.num_layers,
                            first=operator_kind(options.operator).first_removable, ridge=options.ridge,
                            layers=tuple(options.layers or ()), operator=options.operator,
                            problem=functools.partial(removal_problem, config))


def boundary_spans(depth: int, removed: list[int]) -> list[tuple[int, int]]:
    """(s, e) per boundary: X_s enters the first removed layer, X_e the next kept layer (e == depth: the norm)."""
    return [(b["removed"][0], b["removed"][-1] + 1) for b in expected_boundaries(depth, removed)]
