"""Training-session configuration from the environment (prefix INKWELL_SESSION_)."""

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class SessionSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="INKWELL_SESSION_", extra="ignore")

    device: str = Field("cpu", description="cpu | cuda (or cuda:N): where session workers hold their model")
    dtype: str = Field("float32", description="float32 | bfloat16")
    threads: int = Field(2, ge=1, description="torch threads per CPU session worker")
    max_sessions: int = Field(2, ge=1, description="sessions open at once; one more is refused with 429")
    idle_seconds: float = Field(600.0, gt=0, description="a session with no request or heartbeat this long is closed")
    start_timeout: float = Field(300.0, gt=0, description="seconds a session worker may take to load its model")
    reap_interval: float = Field(5.0, gt=0, description="how often idle sessions are looked for")
