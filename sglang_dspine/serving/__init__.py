"""The SGLang side: the plugin SGLang loads, its draft model, worker and draft step."""
