"""The recipe registry: each reward recipe of SPEC §4 as the components it aggregates.

A recipe is data: a name, the components it sums (rows of
:data:`~reward_server.core.components.COMPONENTS`) and a one-line description. Everything that
depends on the set of recipes reads :data:`RECIPES`: scoring (which components, whether the
encoder is needed), the :data:`Recipe` type that validates every request and lists the recipes in
the OpenAPI document, the TRL adapter's reward functions and the command-line choices. Adding a
recipe made of existing components is one :meth:`RecipeRegistry.register` call (or one entry in
:data:`RECIPES` for a built-in one).

The registry is the core's one piece of module state, on purpose: a recipe registered once (by a
deployment's startup code, or a test) is known to every transport of the process at once.
Validation looks it up at request time, never from a list frozen at import.

>>> RECIPES["cfl"].components, RECIPES["cfl"].needs_encoder, RECIPES["sde2"].needs_encoder
(('oc', 'fa', 'len'), False, True)
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import PydanticCustomError, core_schema

from reward_server.core.components import COMPONENTS
from reward_server.core.params import ComponentKey

#: Recipe names: they become TRL metric prefixes and reward-function names, so identifiers.
_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class RecipeSpec:
    """One recipe: the components its reward sums (SPEC §5), in response order."""

    name: str
    components: tuple[ComponentKey, ...]
    #: One line: what the recipe is (shown in the OpenAPI document and the docs).
    description: str
    #: Whether some component reads ``g(H)``: only then may scoring call the encoder.
    needs_encoder: bool = field(init=False)

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"recipe name {self.name!r} must match {_NAME.pattern}")
        unknown = [k for k in self.components if k not in COMPONENTS]
        if unknown or not self.components:
            raise ValueError(
                f"recipe {self.name!r}: components must be a non-empty subset of "
                f"{list(COMPONENTS)}, got {list(self.components)}"
            )
        if len(set(self.components)) != len(self.components):
            raise ValueError(f"recipe {self.name!r}: a component is listed twice")
        needs = any(COMPONENTS[k].needs_embeddings for k in self.components)
        object.__setattr__(self, "needs_encoder", needs)

    def summary(self) -> str:
        """``name = components (description)``, as the request schema lists it.

        >>> RECIPES["cfee"].summary()
        'cfee = oc, fa, re, rd (GRPO-CFEE: count exploration instead of semantic exploration)'
        """
        return f"{self.name} = {', '.join(self.components)} ({self.description})"

    def unused_weights(self, weights: Iterable[str]) -> list[str]:
        """The components among ``weights`` (names set in a request) this recipe does not sum:
        SPEC accepts such a weight and it changes nothing, so an ablation such as ``cfl`` with
        ``sd`` at 0 would never happen. The server warns (:attr:`unused_weight`), the client
        refuses: one rule, one wording.

        >>> RECIPES["cfl"].unused_weights(["sd", "oc", "rd"]), RECIPES["cfl"].unused_weight
        (['rd', 'sd'], "not a component of recipe 'cfl' (oc, fa, len): its weight changes nothing")
        """
        return sorted(k for k in set(weights) if k not in self.components)

    @property
    def unused_weight(self) -> str:
        """What is said of each weight :meth:`unused_weights` finds."""
        listed = ", ".join(self.components)
        return f"not a component of recipe {self.name!r} ({listed}): its weight changes nothing"


class RecipeRegistry(Mapping[str, RecipeSpec]):
    """Recipes by name, in registration order (the order the schema and the docs list them)."""

    def __init__(self, specs: Iterable[RecipeSpec] = ()) -> None:
        self._specs: dict[str, RecipeSpec] = {}
        for spec in specs:
            self._add(spec)

    def _add(self, spec: RecipeSpec) -> None:
        if spec.name in self._specs:
            raise ValueError(f"recipe {spec.name!r} is already registered")
        self._specs[spec.name] = spec

    def register(
        self, name: str, components: Iterable[ComponentKey], description: str
    ) -> RecipeSpec:
        """Add a recipe; every transport accepts it from then on. Raises ``ValueError`` for a
        taken or malformed name, or a component that is not in SPEC §4's table."""
        spec = RecipeSpec(name, tuple(components), description)
        self._add(spec)
        return spec

    def unregister(self, name: str) -> None:
        """Remove a recipe (``KeyError`` if absent); requests naming it are refused again."""
        del self._specs[name]

    def __getitem__(self, name: str) -> RecipeSpec:
        return self._specs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._specs))  # a snapshot: registering while iterating is harmless

    def __len__(self) -> int:
        return len(self._specs)

    def describe(self) -> str:
        """The ``recipe`` field's description: every recipe with its components.

        >>> RECIPES.describe().split("; ")[2]
        'cfl = oc, fa, len (GRPO-CFL: a length term, no exploration)'
        """
        return "component set (SPEC §4): " + "; ".join(s.summary() for s in self.values())


#: Every recipe the server accepts; the first three are the paper's (SPEC §4).
RECIPES = RecipeRegistry(
    [
        RecipeSpec(
            "sde2",
            ("oc", "re", "fa", "sd"),
            "SD-E²: semantic exploration of distinct strategies",
        ),
        RecipeSpec(
            "cfee",
            ("oc", "fa", "re", "rd"),
            "GRPO-CFEE: count exploration instead of semantic exploration",
        ),
        RecipeSpec("cfl", ("oc", "fa", "len"), "GRPO-CFL: a length term, no exploration"),
    ]
)


def _check_registered(name: str) -> str:
    """The error of a ``Literal`` over the recipes registered now (same type and message)."""
    if name in RECIPES:
        return name
    names = [repr(n) for n in RECIPES]
    expected = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
    raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})


class _Registered:
    """Pydantic hooks of :data:`Recipe`: validation and JSON schema read :data:`RECIPES` when
    they run, so a recipe registered after a model was built is accepted and documented."""

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(_check_registered, handler(source))

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        json_schema = handler(schema)
        json_schema.update(enum=list(RECIPES), description=RECIPES.describe())
        return json_schema


#: A registered recipe's name: a ``str`` checked against :data:`RECIPES` at validation time
#: (a pydantic field or FastAPI parameter of this type refuses any other name, and its JSON
#: schema lists the registered ones as an ``enum``).
Recipe = Annotated[str, _Registered()]
