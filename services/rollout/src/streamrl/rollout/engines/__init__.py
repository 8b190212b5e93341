"""Generation engines: one protocol (:mod:`.engine`), two implementations (:mod:`.hf_engine`,
:mod:`.vllm_engine`) that run their model in a driver thread (:mod:`.driver`), and
:func:`.factory.build_engine` to pick one from the config (:mod:`.config`)."""
