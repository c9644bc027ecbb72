"""The one check every layout makes of an `adapter_config.json`: it must describe plain LoRA."""


def plain_lora_problem(adapter_config: dict) -> str | None:
    """What makes `adapter_config` something other than plain LoRA, or None if it is plain LoRA."""
    peft_type = str(adapter_config.get("peft_type", "")).upper()
    if peft_type != "LORA":
        return f"peft_type is {peft_type or 'missing'!r}; only LORA adapters load"
    if adapter_config.get("use_dora"):
        return "use_dora is set; DoRA adapters are not plain LoRA and cannot load"
    return None
