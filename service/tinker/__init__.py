"""Tinker's wire protocol (the `tinker` 0.38 client and tinker-cookbook) as a second front door onto the same
training sessions, registry and serving tier: `/api/v1/...` requests become `SessionManager` calls, sampling
requests the sessions' `sampling.sample`, and `tinker://` paths name saved states and registry versions.
docs/tinker.md lists every call and how inkwell differs."""
