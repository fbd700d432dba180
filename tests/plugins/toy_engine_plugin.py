"""The registry line of a toy fourth engine, as a plugin registers one: named in ``TESSERA_ENGINES``,
imported when the engine table is. It imports no engine code (the class and the reader are dotted names,
imported when used), so it can load before anything else of Tessera."""

from tessera.tables.engines import Capabilities, EngineSpec, register

register(
    EngineSpec(
        name="toyddp",
        module="toy_engine",
        cls="ToyEngine",
        caps=Capabilities(zero=(0,), zero_impls=("ddp",), recompute=("none", "full")),
        summary="a toy: the ddp engine under another name, with its own sharding string and reader",
        libraries="torch DDP",
        reader="toy_engine:READER",
    )
)
