// Server-sent events read from a fetch() body: EventSource cannot send the Authorization header the API needs.

/** Parses the text/event-stream format chunk by chunk; feed() returns the events completed so far. */
export class EventParser {
  constructor() {
    this.buffer = "";
  }

  feed(text) {
    this.buffer += text.replace(/\r\n?/g, "\n");
    const events = [];
    let end;
    while ((end = this.buffer.indexOf("\n\n")) >= 0) {
      const block = this.buffer.slice(0, end);
      this.buffer = this.buffer.slice(end + 2);
      const event = parseBlock(block);
      if (event) events.push(event);
    }
    return events;
  }
}

function parseBlock(block) {
  const event = { id: null, event: "message", data: [] };
  for (const line of block.split("\n")) {
    if (!line || line.startsWith(":")) continue; // a comment: the keepalive
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "data") event.data.push(value);
    else if (field === "id") event.id = value;
    else if (field === "event") event.event = value;
  }
  if (!event.data.length) return null;
  return { ...event, data: event.data.join("\n") };
}

/** Yields the events of a streaming Response until its body ends. */
export async function* readEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  const parser = new EventParser();
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      yield* parser.feed(value);
    }
  } finally {
    await reader.cancel().catch(() => {}); // a consumer that stops early closes the connection
  }
}
