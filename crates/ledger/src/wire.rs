//! The JSON shape of an event, in (`POST /v1/events`) and out (`GET /v1/export`).
//!
//! Parsed by hand from a `serde_json::Value` rather than derived, so that each bad
//! field gets its own message (a negative count, a count too large for 64 bits, a
//! missing field, an unknown field) and the ingest path can say which event in a batch
//! was wrong. Export writes the same shape, so an export can be posted back.
//!
//! ```json
//! {"request_id": "req-1", "origin": "agent-a", "seq": 17, "tenant": "acme",
//!  "descriptors": [["key", "k1"]], "model": "gpt-4o", "time_ms": 1764489600000,
//!  "kind": "usage", "status": "ok",
//!  "input_tokens": 1200, "cached_input_tokens": 200, "output_tokens": 340}
//! ```
//!
//! `kind` defaults to `"usage"`. A `"void"` names `"target"` (the target's request
//! id, or `"target_key"`, its event key in hex); an `"adjust"` names a target and
//! signed token deltas. A correction carries
//! its target's `tenant` and `time_ms` (see [`Event`]). `event_key` may be sent (an
//! export does); it must match the request id.

use serde_json::{Number, Value, json};

use crate::event::{Body, Event, EventKey, Limits, Status, TokenDeltas, Tokens, ValidationError};

const FIELDS: &[&str] = &[
    "request_id",
    "origin",
    "seq",
    "tenant",
    "descriptors",
    "model",
    "time_ms",
    "kind",
    "status",
    "input_tokens",
    "cached_input_tokens",
    "output_tokens",
    "target",
    "target_key",
    "event_key",
];

/// The fields of one event as sent: typed, not yet checked. Both parsers produce it
/// (a JSON `null` counts as absent in both); [`Fields::into_event`] does every
/// semantic check, so the two cannot disagree on what is valid.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Fields {
    request_id: Option<String>,
    origin: Option<String>,
    seq: Option<Number>,
    tenant: Option<String>,
    descriptors: Option<Vec<(String, String)>>,
    model: Option<String>,
    time_ms: Option<Number>,
    kind: Option<String>,
    status: Option<String>,
    input_tokens: Option<Number>,
    cached_input_tokens: Option<Number>,
    output_tokens: Option<Number>,
    target: Option<String>,
    target_key: Option<String>,
    event_key: Option<String>,
}

/// [`Fields`] from a JSON object only. (The derived impl alone would also accept an
/// array of values in field order, which the precise parser refuses.)
struct ObjectFields(Fields);

impl<'de> serde::Deserialize<'de> for ObjectFields {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Fields;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Fields, A::Error> {
                serde::Deserialize::deserialize(serde::de::value::MapAccessDeserializer::new(map))
            }
        }
        d.deserialize_map(V).map(ObjectFields)
    }
}

/// Why a batch was refused. Nothing in it was stored; the cause is the sender's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    /// Not JSON.
    #[error("malformed JSON: {0}")]
    Malformed(String),
    /// JSON, but not an array.
    #[error("the body must be a JSON array of events")]
    NotArray,
    /// More events than allowed.
    #[error("{0} events in one request; at most {1}")]
    TooMany(usize, usize),
    /// One event is invalid.
    #[error("event {index}: {error}")]
    Event {
        /// Its position in the array.
        index: usize,
        /// What is wrong.
        error: ValidationError,
    },
}

/// Parses and validates a `POST /v1/events` body: a JSON array of at most
/// `events_max` events, all valid, or an error naming the first problem.
///
/// Three tiers, one set of rules: a hand-written scanner for the shape agents send
/// (`scan_batch`: plain strings, unsigned integers, no `null`s) reads each event into
/// the same typed fields as the serde path; anything it does not handle (an escape, a
/// negative number, a `null`, bad JSON...) goes to the serde typed path; if that fails
/// too, the body is parsed again through `serde_json::Value` ([`parse_event`]) only to
/// say precisely what is wrong. Every tier ends in the same semantic checks
/// (`Fields::into_event`), so they cannot disagree on what is valid.
pub fn parse_batch(
    body: &[u8],
    now_ms: u64,
    limits: &Limits,
    events_max: usize,
) -> Result<Vec<Event>, BatchError> {
    if let Some((all, total)) = scan_batch(body, events_max) {
        if total > events_max {
            return Err(BatchError::TooMany(total, events_max));
        }
        return fields_to_events(all, now_ms, limits);
    }
    parse_batch_serde(body, now_ms, limits, events_max)
}

/// A JSON array read with at most `max` elements kept: the rest are only counted
/// (`total`), so a body of millions of tiny elements costs no memory before it is
/// refused as too many.
struct Bounded<T> {
    items: Vec<T>,
    total: usize,
}

fn bounded<'de, T: serde::Deserialize<'de>>(
    body: &'de [u8],
    max: usize,
) -> serde_json::Result<Bounded<T>> {
    struct V<T>(usize, std::marker::PhantomData<T>);
    impl<'de, T: serde::Deserialize<'de>> serde::de::Visitor<'de> for V<T> {
        type Value = Bounded<T>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON array")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Bounded<T>, A::Error> {
            let mut items = Vec::new();
            while items.len() < self.0 {
                match seq.next_element::<T>()? {
                    Some(x) => items.push(x),
                    None => {
                        let total = items.len();
                        return Ok(Bounded { items, total });
                    }
                }
            }
            let mut total = items.len();
            while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {
                total += 1;
            }
            Ok(Bounded { items, total })
        }
    }
    use serde::Deserializer as _;
    let mut de = serde_json::Deserializer::from_slice(body);
    let out = (&mut de).deserialize_seq(V::<T>(max, std::marker::PhantomData))?;
    de.end()?;
    Ok(out)
}

/// A JSON value whose objects name no key twice, at any depth. `serde_json::Value`
/// keeps the last of a repeated key; the precise tier reads events through this
/// instead, so that `"output_tokens": 1, "output_tokens": 1000000` is refused as the
/// scanner and the typed tier refuse it, not billed as its last value.
struct UniqueValue(Value);

impl<'de> serde::Deserialize<'de> for UniqueValue {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Value;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
                Ok(Value::Bool(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
                Ok(Value::from(v))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
                Ok(Value::from(v))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
                Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
            }
            fn visit_str<E>(self, v: &str) -> Result<Value, E> {
                Ok(Value::String(v.to_string()))
            }
            fn visit_string<E>(self, v: String) -> Result<Value, E> {
                Ok(Value::String(v))
            }
            fn visit_unit<E>(self) -> Result<Value, E> {
                Ok(Value::Null)
            }
            fn visit_none<E>(self) -> Result<Value, E> {
                Ok(Value::Null)
            }
            fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
                <UniqueValue as serde::Deserialize>::deserialize(d).map(|u| u.0)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Value, A::Error> {
                let mut out = Vec::new();
                while let Some(UniqueValue(v)) = seq.next_element()? {
                    out.push(v);
                }
                Ok(Value::Array(out))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Value, A::Error> {
                let mut out = serde_json::Map::new();
                while let Some(k) = map.next_key::<String>()? {
                    let UniqueValue(v) = map.next_value()?;
                    if out.contains_key(&k) {
                        return Err(serde::de::Error::custom(format_args!(
                            "field {k:?} given twice"
                        )));
                    }
                    out.insert(k, v);
                }
                Ok(Value::Object(out))
            }
        }
        d.deserialize_any(V).map(UniqueValue)
    }
}

/// [`parse_batch`] without the scanner: the serde typed path, then the precise one.
fn parse_batch_serde(
    body: &[u8],
    now_ms: u64,
    limits: &Limits,
    events_max: usize,
) -> Result<Vec<Event>, BatchError> {
    if let Ok(all) = bounded::<ObjectFields>(body, events_max) {
        if all.total > events_max {
            return Err(BatchError::TooMany(all.total, events_max));
        }
        return all
            .items
            .into_iter()
            .enumerate()
            .map(|(index, ObjectFields(f))| {
                f.into_event(now_ms, limits)
                    .map_err(|error| BatchError::Event { index, error })
            })
            .collect();
    }
    // Well-formed JSON at all (read without building it), and an array?
    serde_json::from_slice::<serde::de::IgnoredAny>(body)
        .map_err(|e| BatchError::Malformed(e.to_string()))?;
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'[') {
        return Err(BatchError::NotArray);
    }
    let all = bounded::<UniqueValue>(body, events_max)
        .map_err(|e| BatchError::Malformed(e.to_string()))?;
    if all.total > events_max {
        return Err(BatchError::TooMany(all.total, events_max));
    }
    all.items
        .iter()
        .enumerate()
        .map(|(index, UniqueValue(item))| {
            parse_event(item, now_ms, limits).map_err(|error| BatchError::Event { index, error })
        })
        .collect()
}

fn fields_to_events(
    all: Vec<Fields>,
    now_ms: u64,
    limits: &Limits,
) -> Result<Vec<Event>, BatchError> {
    all.into_iter()
        .enumerate()
        .map(|(index, f)| {
            f.into_event(now_ms, limits)
                .map_err(|error| BatchError::Event { index, error })
        })
        .collect()
}

/// The scanner of [`parse_batch`]'s first tier: a JSON array of event objects whose
/// strings have no escapes and no control characters, whose numbers are unsigned
/// integers that fit 64 bits, with no `null`, no repeated and no unknown field. Returns
/// `None` for anything else (the serde path then decides, with its messages); never
/// accepts what the serde path would refuse.
///
/// Keeps at most `max` events and counts the rest (the second value): a body of
/// millions of empty objects is refused as too many without holding them.
fn scan_batch(body: &[u8], max: usize) -> Option<(Vec<Fields>, usize)> {
    // One UTF-8 check for the whole body; every string is then a slice of it cut at
    // ASCII quotes, so valid too.
    let text = std::str::from_utf8(body).ok()?;
    let mut s = Scanner {
        t: text,
        b: body,
        at: 0,
    };
    let mut out = Vec::with_capacity((body.len() / 200 + 1).min(max.saturating_add(1)));
    let mut total = 0usize;
    s.ws();
    s.list(b'[', b']', |s| {
        let f = s.event()?;
        total += 1;
        if out.len() < max {
            out.push(f);
        }
        Some(())
    })?;
    s.ws();
    (s.at == body.len()).then_some((out, total))
}

struct Scanner<'a> {
    t: &'a str,
    b: &'a [u8],
    at: usize,
}

impl<'a> Scanner<'a> {
    fn ws(&mut self) {
        while let Some(b' ' | b'\n' | b'\r' | b'\t') = self.b.get(self.at) {
            self.at += 1;
        }
    }
    fn peek(&self) -> Option<u8> {
        self.b.get(self.at).copied()
    }
    fn next(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.at += 1;
        Some(c)
    }
    fn eat(&mut self, c: u8) -> Option<()> {
        (self.next()? == c).then_some(())
    }
    /// `open`, then items separated by commas (each read by `item`, whitespace
    /// around it skipped), then `close`; an empty list is allowed.
    fn list(
        &mut self,
        open: u8,
        close: u8,
        mut item: impl FnMut(&mut Self) -> Option<()>,
    ) -> Option<()> {
        self.eat(open)?;
        self.ws();
        if self.peek() == Some(close) {
            self.at += 1;
            return Some(());
        }
        loop {
            self.ws();
            item(self)?;
            self.ws();
            match self.next()? {
                b',' => continue,
                c if c == close => return Some(()),
                _ => return None,
            }
        }
    }
    /// A string with no escape and no control character, as `&str`.
    fn str(&mut self) -> Option<&'a str> {
        self.eat(b'"')?;
        let start = self.at;
        loop {
            match self.next()? {
                b'"' => break,
                b'\\' => return None,
                c if c < 0x20 => return None,
                _ => {}
            }
        }
        self.t.get(start..self.at - 1)
    }
    /// An unsigned integer without leading zeros that fits 64 bits.
    fn number(&mut self) -> Option<Number> {
        let start = self.at;
        let mut v: u64 = 0;
        while let Some(c @ b'0'..=b'9') = self.peek() {
            v = v.checked_mul(10)?.checked_add(u64::from(c - b'0'))?;
            self.at += 1;
        }
        let digits = self.at - start;
        if digits == 0 || (digits > 1 && self.b[start] == b'0') {
            return None;
        }
        // A fraction or an exponent: the serde path decides.
        if let Some(b'.' | b'e' | b'E') = self.peek() {
            return None;
        }
        Some(Number::from(v))
    }
    fn descriptors(&mut self) -> Option<Vec<(String, String)>> {
        let mut out = Vec::new();
        self.list(b'[', b']', |s| {
            s.eat(b'[')?;
            s.ws();
            let k = s.str()?;
            s.ws();
            s.eat(b',')?;
            s.ws();
            let v = s.str()?;
            s.ws();
            s.eat(b']')?;
            out.push((k.to_string(), v.to_string()));
            Some(())
        })?;
        Some(out)
    }
    fn event(&mut self) -> Option<Fields> {
        let mut f = Fields::default();
        let mut seen = 0u32;
        self.list(b'{', b'}', |s| {
            let key = s.str()?;
            let i = FIELDS.iter().position(|k| *k == key)?;
            if seen & (1 << i) != 0 {
                return None;
            }
            seen |= 1 << i;
            s.ws();
            s.eat(b':')?;
            s.ws();
            match key {
                "seq" => f.seq = Some(s.number()?),
                "time_ms" => f.time_ms = Some(s.number()?),
                "input_tokens" => f.input_tokens = Some(s.number()?),
                "cached_input_tokens" => f.cached_input_tokens = Some(s.number()?),
                "output_tokens" => f.output_tokens = Some(s.number()?),
                "descriptors" => f.descriptors = Some(s.descriptors()?),
                _ => {
                    let v = Some(s.str()?.to_string());
                    match key {
                        "request_id" => f.request_id = v,
                        "origin" => f.origin = v,
                        "tenant" => f.tenant = v,
                        "model" => f.model = v,
                        "kind" => f.kind = v,
                        "status" => f.status = v,
                        "target" => f.target = v,
                        "target_key" => f.target_key = v,
                        "event_key" => f.event_key = v,
                        _ => return None,
                    }
                }
            }
            Some(())
        })?;
        Some(f)
    }
}

/// Parses and validates one event from a JSON value, with a precise message for each
/// wrong type. `now_ms` is the ingesting node's clock.
pub fn parse_event(v: &Value, now_ms: u64, limits: &Limits) -> Result<Event, ValidationError> {
    fields_of(v)?.into_event(now_ms, limits)
}

fn fields_of(v: &Value) -> Result<Fields, ValidationError> {
    let obj = v.as_object().ok_or(ValidationError::WrongType {
        field: "(event)".into(),
        expected: "a JSON object",
    })?;
    if let Some(k) = obj.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(ValidationError::UnknownField(k.clone()));
    }
    let string = |field: &str| match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(ValidationError::WrongType {
            field: field.into(),
            expected: "a string",
        }),
    };
    let number = |field: &str| match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => Ok(Some(n.clone())),
        Some(_) => Err(ValidationError::WrongType {
            field: field.into(),
            expected: "an integer",
        }),
    };
    let descriptors = match obj.get("descriptors") {
        None | Some(Value::Null) => None,
        Some(Value::Array(items)) => {
            let mut out = Vec::with_capacity(items.len());
            for item in items {
                match item.as_array().map(Vec::as_slice) {
                    Some([Value::String(k), Value::String(v)]) => out.push((k.clone(), v.clone())),
                    _ => {
                        return Err(ValidationError::WrongType {
                            field: "descriptors".into(),
                            expected: "an array of [key, value] string pairs",
                        });
                    }
                }
            }
            Some(out)
        }
        Some(_) => {
            return Err(ValidationError::WrongType {
                field: "descriptors".into(),
                expected: "an array of [key, value] string pairs",
            });
        }
    };
    Ok(Fields {
        request_id: string("request_id")?,
        origin: string("origin")?,
        seq: number("seq")?,
        tenant: string("tenant")?,
        descriptors,
        model: string("model")?,
        time_ms: number("time_ms")?,
        kind: string("kind")?,
        status: string("status")?,
        input_tokens: number("input_tokens")?,
        cached_input_tokens: number("cached_input_tokens")?,
        output_tokens: number("output_tokens")?,
        target: string("target")?,
        target_key: string("target_key")?,
        event_key: string("event_key")?,
    })
}

impl Fields {
    fn into_event(self, now_ms: u64, limits: &Limits) -> Result<Event, ValidationError> {
        let f = self;
        let request_id = f.request_id.ok_or(ValidationError::Missing("request_id"))?;
        let origin = f.origin.ok_or(ValidationError::Missing("origin"))?;
        let seq =
            unsigned("seq", f.seq.as_ref(), u64::MAX)?.ok_or(ValidationError::Missing("seq"))?;
        let tenant = f.tenant.ok_or(ValidationError::Missing("tenant"))?;
        let descriptors = f.descriptors.unwrap_or_default();
        if descriptors.len() > limits.descriptors_max {
            return Err(ValidationError::TooManyDescriptors(
                descriptors.len(),
                limits.descriptors_max,
            ));
        }
        let time_ms = unsigned("time_ms", f.time_ms.as_ref(), u64::MAX)?
            .ok_or(ValidationError::Missing("time_ms"))?;
        let kind = f.kind.as_deref().unwrap_or("usage");
        let target = match f.target.as_deref() {
            None => None,
            Some("") => {
                return Err(ValidationError::WrongType {
                    field: "target".into(),
                    expected: "a non-empty string (the target's request_id)",
                });
            }
            Some(t) => Some(EventKey::from_request_id(t)),
        };
        let target = match (target, f.target_key.as_deref()) {
            (t, None) => t,
            (None, Some(k)) => Some(EventKey::from_hex(k).ok_or(ValidationError::WrongType {
                field: "target_key".into(),
                expected: "32 hex characters (the target's event_key)",
            })?),
            (Some(_), Some(_)) => {
                return Err(ValidationError::NotAllowed {
                    field: "target_key",
                    kind: "event that names \"target\"; send one of them",
                });
            }
        };
        let (model, body) = match kind {
            "usage" => {
                if target.is_some() {
                    return Err(ValidationError::NotAllowed {
                        field: "target",
                        kind: "usage",
                    });
                }
                let status = match f.status {
                    None => return Err(ValidationError::Missing("status")),
                    Some(s) => Status::parse(&s).ok_or(ValidationError::BadValue {
                        field: "status",
                        value: s,
                        expected: "ok, upstream_error, client_gone, expired",
                    })?,
                };
                let max = limits.tokens_max;
                let tokens = Tokens {
                    input_tokens: unsigned("input_tokens", f.input_tokens.as_ref(), max)?
                        .ok_or(ValidationError::Missing("input_tokens"))?,
                    cached_input_tokens: unsigned(
                        "cached_input_tokens",
                        f.cached_input_tokens.as_ref(),
                        max,
                    )?
                    .unwrap_or(0),
                    output_tokens: unsigned("output_tokens", f.output_tokens.as_ref(), max)?
                        .ok_or(ValidationError::Missing("output_tokens"))?,
                };
                let model = f.model.ok_or(ValidationError::Missing("model"))?;
                (model, Body::Usage { status, tokens })
            }
            "void" | "adjust" => {
                let kind_name = if kind == "void" { "void" } else { "adjust" };
                let target = target.ok_or(ValidationError::Missing("target"))?;
                if f.status.is_some() {
                    return Err(ValidationError::NotAllowed {
                        field: "status",
                        kind: kind_name,
                    });
                }
                let model = f.model.unwrap_or_default();
                if kind == "void" {
                    for (field, v) in [
                        ("input_tokens", &f.input_tokens),
                        ("cached_input_tokens", &f.cached_input_tokens),
                        ("output_tokens", &f.output_tokens),
                    ] {
                        if v.is_some() {
                            return Err(ValidationError::NotAllowed {
                                field,
                                kind: "void",
                            });
                        }
                    }
                    (model, Body::Void { target })
                } else {
                    let max = limits.tokens_max;
                    let deltas = TokenDeltas {
                        input_tokens: signed("input_tokens", f.input_tokens.as_ref(), max)?,
                        cached_input_tokens: signed(
                            "cached_input_tokens",
                            f.cached_input_tokens.as_ref(),
                            max,
                        )?,
                        output_tokens: signed("output_tokens", f.output_tokens.as_ref(), max)?,
                    };
                    (model, Body::Adjust { target, deltas })
                }
            }
            other => {
                return Err(ValidationError::BadValue {
                    field: "kind",
                    value: other.to_string(),
                    expected: "usage, void, adjust",
                });
            }
        };
        let event = Event {
            request_id,
            origin,
            seq,
            tenant,
            descriptors,
            model,
            time_ms,
            body,
        };
        if let Some(sent) = f.event_key {
            let derived = event.key();
            if EventKey::from_hex(&sent) != Some(derived) {
                return Err(ValidationError::KeyMismatch {
                    sent,
                    derived: derived.to_hex(),
                });
            }
        }
        event.validate(now_ms, limits)?;
        Ok(event)
    }
}

/// An unsigned integer in `0..=max`, or `None` when absent.
fn unsigned(
    field: &'static str,
    n: Option<&Number>,
    max: u64,
) -> Result<Option<u64>, ValidationError> {
    let Some(n) = n else {
        return Ok(None);
    };
    if let Some(v) = n.as_u64() {
        if v <= max {
            return Ok(Some(v));
        }
    } else if n.as_i64().is_some() || n.as_f64().is_some_and(|f| f < 0.0) {
        return Err(ValidationError::Negative {
            field,
            value: n.to_string(),
        });
    }
    Err(ValidationError::OutOfRange {
        field,
        value: n.to_string(),
        max,
    })
}

/// A signed integer with `|v| <= max`; absent means 0.
fn signed(field: &'static str, n: Option<&Number>, max: u64) -> Result<i64, ValidationError> {
    let Some(n) = n else {
        return Ok(0);
    };
    match n.as_i64() {
        Some(v) if v.unsigned_abs() <= max => Ok(v),
        _ => Err(ValidationError::OutOfRange {
            field,
            value: n.to_string(),
            max,
        }),
    }
}

/// The JSON shape of a stored event (as `GET /v1/export` writes it). Corrections
/// name their target by `target_key` (the store keeps keys, not request ids).
pub fn event_json(e: &Event) -> Value {
    let mut v = json!({
        "event_key": e.key().to_hex(),
        "request_id": e.request_id,
        "origin": e.origin,
        "seq": e.seq,
        "tenant": e.tenant,
        "descriptors": e.descriptors.iter().map(|(k, v)| json!([k, v])).collect::<Vec<_>>(),
        "model": e.model,
        "time_ms": e.time_ms,
        "kind": e.body.kind(),
    });
    let obj = v.as_object_mut().expect("json! of an object is an object");
    match &e.body {
        Body::Usage { status, tokens } => {
            obj.insert("status".into(), status.as_str().into());
            obj.insert("input_tokens".into(), tokens.input_tokens.into());
            obj.insert(
                "cached_input_tokens".into(),
                tokens.cached_input_tokens.into(),
            );
            obj.insert("output_tokens".into(), tokens.output_tokens.into());
        }
        Body::Void { target } => {
            obj.insert("target_key".into(), target.to_hex().into());
        }
        Body::Adjust { target, deltas } => {
            obj.insert("target_key".into(), target.to_hex().into());
            obj.insert(
                "input_tokens".into(),
                Number::from(deltas.input_tokens).into(),
            );
            obj.insert(
                "cached_input_tokens".into(),
                Number::from(deltas.cached_input_tokens).into(),
            );
            obj.insert(
                "output_tokens".into(),
                Number::from(deltas.output_tokens).into(),
            );
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::HOUR_MS;
    use proptest::prelude::*;

    /// Bodies in the shapes clients send: the benchmark's, an export's (event keys,
    /// kinds, descriptors), corrections (negative deltas: the serde path), spaces.
    fn sample_bodies() -> Vec<Vec<u8>> {
        let events = crate::testing::usage_stream(5, "node-1", "agent-a", 40, NOW);
        let export: Vec<Value> = events.iter().map(event_json).collect();
        let void = crate::testing::correction("v1", &events[0], None);
        let adjust = crate::testing::correction(
            "a1",
            &events[1],
            Some(crate::event::TokenDeltas {
                input_tokens: -3,
                cached_input_tokens: 0,
                output_tokens: 2,
            }),
        );
        let mut with_corrections = export.clone();
        with_corrections.push(event_json(&void));
        with_corrections.push(event_json(&adjust));
        let bench = format!(
            r#"[{{"request_id":"node-000000001-0000","origin":"agent-a","seq":0,"tenant":"t0","descriptors":[["key","k0"]],"model":"gpt-4o","time_ms":{NOW},"status":"ok","input_tokens":100,"cached_input_tokens":0,"output_tokens":0}}]"#
        );
        vec![
            serde_json::to_vec(&export).expect("json"),
            serde_json::to_vec_pretty(&export).expect("json"),
            serde_json::to_vec(&with_corrections).expect("json"),
            bench.into_bytes(),
            b" [ ] ".to_vec(),
        ]
    }

    #[test]
    fn the_scanner_reads_the_common_shapes_and_agrees_with_the_serde_path() {
        let limits = Limits::default();
        for (i, body) in sample_bodies().iter().enumerate() {
            let fast = parse_batch(body, NOW, &limits, 50_000);
            assert_eq!(
                fast,
                parse_batch_serde(body, NOW, &limits, 50_000),
                "body {i}"
            );
            assert!(fast.is_ok(), "body {i}: {fast:?}");
            // The scanner takes the plain shapes itself; corrections with negative
            // deltas go to the serde path.
            assert_eq!(scan_batch(body, usize::MAX).is_some(), i != 2, "body {i}");
        }
    }

    #[test]
    fn the_scanner_leaves_what_it_does_not_handle_to_the_serde_path() {
        for body in [
            r#"[{"request_id":"a\"b"}]"#,        // an escape
            r#"[{"request_id":null}]"#,          // a null
            r#"[{"seq":-1}]"#,                   // a negative number
            r#"[{"seq":1.5}]"#,                  // a fraction
            r#"[{"seq":1e3}]"#,                  // an exponent
            r#"[{"seq":01}]"#,                   // a leading zero
            r#"[{"seq":18446744073709551616}]"#, // beyond 64 bits
            r#"[{"seq":1,"seq":2}]"#,            // a repeated field
            r#"[{"sequence":1}]"#,               // an unknown field
            r#"[{"seq":1},]"#,                   // a trailing comma
            r#"[{"seq":1}] x"#,                  // trailing bytes
            r#"{"seq":1}"#,                      // not an array
            "[{\"model\":\"a\u{1}b\"}]",         // a control character
            r#"[{"descriptors":[["a"]]}]"#,      // a descriptor that is not a pair
        ] {
            assert!(scan_batch(body.as_bytes(), usize::MAX).is_none(), "{body}");
        }
        assert!(
            scan_batch(&[b'[', b'"', 0xff, b'"', b']'], usize::MAX).is_none(),
            "bad UTF-8"
        );
    }

    proptest! {
        /// Damage a valid body anywhere: whenever the scanner still accepts it, the
        /// answer (events or the error) is the serde path's.
        #[test]
        fn the_scanner_never_disagrees_with_the_serde_path(
            which in 0usize..5,
            edits in proptest::collection::vec((any::<usize>(), 0u8..4, prop::sample::select(
                b"\"\\,:[]{}-0.e 9an\x01\xff".to_vec())), 1..4),
        ) {
            let mut body = sample_bodies().swap_remove(which);
            for (at, op, byte) in edits {
                let at = at % (body.len() + 1);
                match op {
                    0 => body.insert(at, byte),
                    1 if at < body.len() => { body.remove(at); }
                    2 if at < body.len() => body[at] = byte,
                    _ => body.truncate(at),
                }
            }
            let limits = Limits::default();
            if scan_batch(&body, usize::MAX).is_some() {
                prop_assert_eq!(
                    parse_batch(&body, NOW, &limits, 50_000),
                    parse_batch_serde(&body, NOW, &limits, 50_000)
                );
            }
        }
    }

    const NOW: u64 = 490_000 * HOUR_MS;

    fn base() -> Value {
        json!({"request_id": "r1", "origin": "a", "seq": 1, "tenant": "acme",
               "model": "gpt-4o", "time_ms": NOW, "status": "ok",
               "input_tokens": 10, "cached_input_tokens": 2, "output_tokens": 5})
    }

    fn err(v: Value) -> String {
        parse_event(&v, NOW, &Limits::default())
            .expect_err("should be refused")
            .to_string()
    }

    fn with(field: &str, value: Value) -> Value {
        let mut v = base();
        v[field] = value;
        v
    }

    fn without(field: &str) -> Value {
        let mut v = base();
        v.as_object_mut().unwrap().remove(field);
        v
    }

    #[test]
    fn a_well_formed_usage_event_parses() {
        let e = parse_event(&base(), NOW, &Limits::default()).unwrap();
        assert_eq!(e.request_id, "r1");
        assert_eq!(
            e.body,
            Body::Usage {
                status: Status::Ok,
                tokens: Tokens {
                    input_tokens: 10,
                    cached_input_tokens: 2,
                    output_tokens: 5
                }
            }
        );
    }

    #[test]
    fn each_missing_required_field_is_named() {
        for f in [
            "request_id",
            "origin",
            "seq",
            "tenant",
            "model",
            "time_ms",
            "status",
            "input_tokens",
            "output_tokens",
        ] {
            assert_eq!(err(without(f)), format!("missing field \"{f}\""));
        }
    }

    #[test]
    fn a_negative_count_is_refused_as_negative() {
        assert_eq!(
            err(with("input_tokens", json!(-5))),
            "field \"input_tokens\": -5 is negative; token counts are integers >= 0"
        );
    }

    #[test]
    fn a_count_beyond_64_bits_or_the_bound_or_fractional_is_out_of_range() {
        let huge: Value = serde_json::from_str("18446744073709551616").unwrap();
        assert!(err(with("output_tokens", huge)).contains("is not an integer in 0..="));
        assert!(err(with("output_tokens", json!(1u64 << 41))).contains("is not an integer"));
        assert!(err(with("output_tokens", json!(1.5))).contains("is not an integer"));
        assert!(err(with("seq", json!("7"))).contains("expected an integer"));
    }

    #[test]
    fn unknown_fields_and_kinds_are_refused() {
        assert_eq!(
            err(with("inptu_tokens", json!(1))),
            "unknown field \"inptu_tokens\""
        );
        assert!(err(with("kind", json!("refund"))).contains("unknown value \"refund\""));
    }

    #[test]
    fn a_void_needs_a_target_and_carries_no_counts() {
        let mut v = json!({"request_id": "v1", "origin": "a", "seq": 2, "tenant": "acme",
                           "time_ms": NOW, "kind": "void"});
        assert_eq!(err(v.clone()), "missing field \"target\"");
        v["target"] = json!("r1");
        let e = parse_event(&v, NOW, &Limits::default()).unwrap();
        assert_eq!(
            e.body,
            Body::Void {
                target: EventKey::from_request_id("r1")
            }
        );
        v["input_tokens"] = json!(1);
        assert!(err(v).contains("not allowed on a void event"));
    }

    #[test]
    fn the_fast_batch_parser_agrees_with_the_precise_one_on_every_case() {
        let mut cases: Vec<Value> = vec![base(), json!([1, 2]), json!("x"), json!(null)];
        for f in [
            "request_id",
            "seq",
            "tenant",
            "status",
            "input_tokens",
            "model",
        ] {
            cases.push(without(f));
        }
        for (f, v) in [
            ("input_tokens", json!(-5)),
            ("output_tokens", json!(1.5)),
            ("output_tokens", json!(1u64 << 41)),
            ("seq", json!("7")),
            ("tenant", json!(7)),
            ("tenant", json!(null)),
            ("kind", json!(null)),
            ("kind", json!("void")),
            ("kind", json!("adjust")),
            ("status", json!("great")),
            ("descriptors", json!([["k", "v"]])),
            ("descriptors", json!([["k", "v", "x"]])),
            ("descriptors", json!({"k": "v"})),
            ("target", json!("")),
            ("target", json!("r0")),
            ("event_key", json!("00")),
            ("unknown", json!(1)),
            ("cached_input_tokens", json!(11)),
        ] {
            cases.push(with(f, v));
        }
        let mut void = json!({"request_id": "v1", "origin": "a", "seq": 2, "tenant": "acme",
                              "time_ms": NOW, "kind": "void", "target": "r1"});
        cases.push(void.clone());
        void["output_tokens"] = json!(3);
        cases.push(void);
        // An event given as an array of values in field order.
        cases.push(json!([
            "r1", "a", 1, "acme", null, "m", NOW, null, "ok", 1, 0, 1
        ]));
        let limits = Limits::default();
        for case in cases {
            let precise = parse_event(&case, NOW, &limits);
            let batch = parse_batch(json!([case]).to_string().as_bytes(), NOW, &limits, 10);
            let expected = precise
                .map(|e| vec![e])
                .map_err(|error| BatchError::Event { index: 0, error });
            assert_eq!(batch, expected, "case {case}");
        }
        assert_eq!(
            parse_batch(b"[", NOW, &limits, 10).unwrap_err().to_string(),
            "malformed JSON: EOF while parsing a list at line 1 column 1"
        );
        assert_eq!(
            parse_batch(b"{}", NOW, &limits, 10),
            Err(BatchError::NotArray)
        );
        let two = json!([base(), base()]).to_string();
        assert_eq!(
            parse_batch(two.as_bytes(), NOW, &limits, 1),
            Err(BatchError::TooMany(2, 1))
        );
    }

    /// Review (twenty-seventh session): the scanner and the typed tier refused a field
    /// given twice, but the precise tier read events through `serde_json::Value`,
    /// which keeps the last value: the batch was accepted and billed 1,000,000 output
    /// tokens. And a body of millions of empty objects was held whole (~2 GB) before
    /// it was refused as too many.
    #[test]
    fn a_field_given_twice_is_refused_by_every_tier_and_too_many_are_only_counted() {
        let limits = Limits::default();
        let body = r#"[{"request_id":"r1","origin":"a","seq":1,"tenant":"t","model":"m",
            "time_ms":NOW,"status":"ok","input_tokens":5,"output_tokens":1,
            "output_tokens":1000000}]"#
            .replace("NOW", &NOW.to_string());
        let e = parse_batch(body.as_bytes(), NOW, &limits, 10).unwrap_err();
        assert!(
            e.to_string().contains("\"output_tokens\" given twice"),
            "{e}"
        );
        // The same in an escape (so not the scanner), and inside descriptors.
        let escaped = body.replace(r#""tenant":"t""#, r#""tenant":"\u0074""#);
        let e = parse_batch(escaped.as_bytes(), NOW, &limits, 10).unwrap_err();
        assert!(e.to_string().contains("given twice"), "{e}");
        let mut v = base();
        v["descriptors"] = json!({"team": "red"});
        let twice = json!([v])
            .to_string()
            .replace(r#"{"team":"red"}"#, r#"{"team":"red","team":"blue"}"#);
        let e = parse_batch(twice.as_bytes(), NOW, &limits, 10).unwrap_err();
        assert!(e.to_string().contains(r#""team" given twice"#), "{e}");
        // Too many: counted exactly on every tier, without being kept.
        let empties = format!("[{}]", vec!["{}"; 1_000].join(","));
        assert_eq!(
            parse_batch(empties.as_bytes(), NOW, &limits, 10),
            Err(BatchError::TooMany(1_000, 10))
        );
        let valid = json!(vec![base(); 300]).to_string();
        assert_eq!(
            parse_batch(valid.as_bytes(), NOW, &limits, 10),
            Err(BatchError::TooMany(300, 10))
        );
        let typed = valid.replace(r#""acme""#, r#""\u0061cme""#);
        assert_eq!(
            parse_batch(typed.as_bytes(), NOW, &limits, 10),
            Err(BatchError::TooMany(300, 10))
        );
    }

    #[test]
    fn an_exported_event_parses_back_to_itself() {
        let e = parse_event(&base(), NOW, &Limits::default()).unwrap();
        let back = parse_event(&event_json(&e), NOW, &Limits::default()).unwrap();
        assert_eq!(back, e);
        let wrong = with("event_key", json!("00".repeat(16)));
        assert!(err(wrong).contains("does not match"));
    }
}
