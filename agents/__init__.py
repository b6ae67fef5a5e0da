"""Antiphon's client SDK: async and blocking clients for the websocket and REST APIs, and
MetaGPT-style agents whose call graph becomes advisory requests. Needs no vLLM or torch."""

from antiphon.agents.client import AsyncAntiphon, ChatReply, Session
from antiphon.agents.errors import (
    AntiphonError,
    AuthenticationError,
    BusyError,
    ConnectionLostError,
    InvalidRequestError,
    NotFoundError,
    RequestTimeoutError,
    ServerError,
)
from antiphon.agents.sync import Antiphon
from antiphon.agents.team import Action, CallGraphHooks, Environment, Message, Role

__all__ = [
    "Action", "Antiphon", "AntiphonError", "AsyncAntiphon", "AuthenticationError", "BusyError",
    "CallGraphHooks", "ChatReply", "ConnectionLostError", "Environment", "InvalidRequestError",
    "Message", "NotFoundError", "RequestTimeoutError", "Role", "ServerError", "Session",
]
