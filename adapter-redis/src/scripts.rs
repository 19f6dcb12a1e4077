//! The Lua scripts: each operation is one script, run with `EVALSHA` (`client.rs` loads it with
//! `SCRIPT LOAD` and sends it once more when the server answers `NOSCRIPT`, for example after a
//! restart or a `SCRIPT FLUSH`).
//!
//! Every script but [`RENEW_MANY`] touches only keys of one lock (or one fenced resource), which
//! share a hash tag, so they run on a Redis Cluster node too. Tokens are handled as decimal strings (compared by
//! length, then lexically) so that Lua's double-precision numbers never round them.
//!
//! Writes are ordered so that an error part-way (for example `OOM` on the first write when the
//! server is out of memory) leaves nothing half-done: the acquire script reads first, then
//! increments the counter, and sets the lock last; a failed attempt writes nothing at all (no AOF
//! fsync), like `SET NX PX` first would, while a token is never issued without its lock value.

use std::sync::LazyLock;

use redis::Script;

const LT: &str = r"
local function lt(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
";

/// Acquire: `KEYS = [lock, counter]`, `ARGV = [head, tail, ttl_ms, floor or '', clock_tokens]`.
///
/// Returns `{1, token}` when this run granted the lock (the lock now holds `head .. token .. tail`
/// with `PX ttl_ms`), or `{0, holder_value, holder_pttl_ms}` when the key is held by another
/// owner. Idempotent per nonce: when the lock already carries `head` (an earlier attempt of the
/// same call applied but its reply was lost), it returns `{2, token}` with that grant's token and
/// sets the lock's `PX` to `ttl_ms` again: a write of this connection, so that a `WAIT` after
/// this script covers the earlier grant, written on a connection since dropped (the replication
/// stream is ordered; a `WAIT` on a connection that wrote nothing returns at once, counting
/// replicas that never received it). The server then holds the lock longer than the caller
/// counts, which counts validity from the earliest request that may have written it (and from
/// this request's send otherwise).
///
/// A counter that is not a decimal token (written from outside: negative, leading zeros, not a
/// number) is answered `{3, counter}` and nothing is written: incrementing it would issue tokens
/// out of order (a negative counter counts up to `0`, `1`, ... again).
///
/// The token is the counter after `INCR`. With `clock_tokens` `1` the counter is first raised
/// to the server's clock in microseconds when it is below it (or does not exist: first use of
/// the key, or lost: deleted by an operator, evicted, flushed, never persisted before a crash,
/// or never replicated to the replica a failover promoted), so every token is
/// `max(counter + 1, TIME + 1)` (one write of the counter either way): above every token issued before, as long as the clock of the
/// server issuing it is not behind the clock of the server that issued those by more than the
/// time between the two grants. It is never below `floor`.
const ACQUIRE_BODY: &str = r"
local cur = redis.call('GET', KEYS[1])
if cur then
  if string.sub(cur, 1, #ARGV[1]) == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    return {2, string.match(cur, '^v1|%x+|(%d+)|')}
  end
  return {0, cur, redis.call('PTTL', KEYS[1])}
end
local c = redis.call('GET', KEYS[2])
if c and c ~= '0' and not string.find(c, '^[1-9]%d*$') then
  return {3, c}
end
local base = c
if ARGV[5] == '1' then
  local t = redis.call('TIME')
  local now = t[1] .. string.format('%06d', tonumber(t[2]))
  if (not base) or lt(base, now) then base = now end
end
if ARGV[4] ~= '' and ((not base) or lt(base, ARGV[4])) then
  base = ARGV[4]
end
local token
if base and base ~= c then
  token = inc(base)
  if lt('9223372036854775807', token) then
    return redis.error_reply('ERR token above 9223372036854775807')
  end
  redis.call('SET', KEYS[2], token)
else
  redis.call('INCR', KEYS[2])
  token = redis.call('GET', KEYS[2])
end
redis.call('SET', KEYS[1], ARGV[1] .. token .. ARGV[2], 'PX', ARGV[3])
return {1, token}
";

/// `inc(s)`: the decimal string `s` (digits, no sign, no leading zero) plus one, exactly (a
/// Lua number would round above 2^53). With it a grant that raises the counter (to the clock or
/// the floor) writes it once, instead of `SET` then `INCR` then `GET`.
const INC: &str = r"
local function inc(s)
  local i = #s
  while i > 0 and string.byte(s, i) == 57 do i = i - 1 end
  if i == 0 then return '1' .. string.rep('0', #s) end
  return string.sub(s, 1, i - 1) .. string.char(string.byte(s, i) + 1) .. string.rep('0', #s - i)
end
";

/// The common tail of renew and release: why the lock is not ours.
/// `-2`: revoked by force_release; `-1`: another owner holds it; `0`: nobody does (expired).
const NOT_OURS: &str = r"
local rev = redis.call('GET', KEYS[2])
if rev and string.sub(rev, 1, #head) == head then return -2 end
if cur then return -1 end
return 0
";

/// Renew: `KEYS = [lock, revoked]`, `ARGV = [head, ttl_ms]`. `1` when extended, else see
/// `NOT_OURS`.
const RENEW_BODY: &str = r"
local head = ARGV[1]
local cur = redis.call('GET', KEYS[1])
if cur and string.sub(cur, 1, #head) == head then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
";

/// Renew many locks (see [`crate::renewals`]): `KEYS = [lock1, revoked1, lock2, revoked2, ...]`,
/// `ARGV = [head1, ttl_ms1, head2, ttl_ms2, ...]`. One code per lock, in order, each as
/// [`RENEW`] answers it, or `-3` for a lock whose keys hold a value of another type (written
/// from outside): the single-lock script fails with `WRONGTYPE` there, and here that one lock's
/// renewal fails without failing the others'.
const RENEW_MANY_SRC: &str = r"
local out = {}
for i = 1, #KEYS, 2 do
  local head = ARGV[i]
  local cur = redis.pcall('GET', KEYS[i])
  local rev = false
  if type(cur) ~= 'table' and not (cur and string.sub(cur, 1, #head) == head) then
    rev = redis.pcall('GET', KEYS[i + 1])
  end
  if type(cur) == 'table' or type(rev) == 'table' then
    out[#out + 1] = -3
  elseif cur and string.sub(cur, 1, #head) == head then
    redis.call('PEXPIRE', KEYS[i], ARGV[i + 1])
    out[#out + 1] = 1
  else
    if rev and string.sub(rev, 1, #head) == head then
      out[#out + 1] = -2
    elseif cur then
      out[#out + 1] = -1
    else
      out[#out + 1] = 0
    end
  end
end
return out
";

/// Release (compare-and-delete, then wake waiters): `KEYS = [lock, revoked]`,
/// `ARGV = [head, channel]`. `1` when deleted, else see `NOT_OURS`.
///
/// The `PUBLISH` is a `pcall`: an ACL user without the channel (`NOPERM`) still releases (a
/// script's error does not undo the `DEL` before it, so a `call` reported a failed release for a
/// key already deleted); waiters then find the key free by polling.
const RELEASE_BODY: &str = r"
local head = ARGV[1]
local cur = redis.call('GET', KEYS[1])
if cur and string.sub(cur, 1, #head) == head then
  redis.call('DEL', KEYS[1])
  redis.pcall('PUBLISH', ARGV[2], 'released')
  return 1
end
";

/// Force release: `KEYS = [lock, revoked, audit, counter]`,
/// `ARGV = [channel, actor, reason, at_ms, audit_maxlen, marker_ms_if_no_ttl, expected_token]`.
///
/// Deletes the lock whoever holds it, keeps the removed value under `revoked` for the rest of its
/// TTL (so the old holder's renew reports `Revoked`), wakes waiters, and appends actor, reason and
/// the removed holder's token and owner (never its nonce) to the capped audit stream. Returns
/// `{removed_value, pttl_ms, found_token}` or `{}` when the key was free (the attempt is audited
/// either way).
///
/// With a non-empty `expected_token` it is a compare-and-delete in this one script: unless the
/// lock value's token is exactly that decimal, nothing is deleted or audited and the reply is
/// `{'refused', found_token}`, or `{'refused'}` when the key is free. A value this adapter did
/// not write is taken to have the newest issued token (the counter), as `inspect` reports it;
/// `found_token` is `''` when no token was ever issued for the key; the audit entry names the
/// same token the reply does.
///
/// An audit key holding anything but a stream (another tool's write) would fail the `XADD` after
/// the `DEL` (a script's writes are not rolled back): the script then changes nothing and
/// replies `{'audit_not_a_stream', type}`.
const FORCE_RELEASE_SRC: &str = r"
local audit_type = redis.call('TYPE', KEYS[3])['ok']
if audit_type ~= 'none' and audit_type ~= 'stream' then
  return {'audit_not_a_stream', audit_type}
end
local cur = redis.call('GET', KEYS[1])
local tok, owner
if cur then
  local _
  _, _, tok, owner = string.find(cur, '^v1|%x+|(%d+)|%d+|([^|]*)|')
end
local found = tok
if cur and not found then found = redis.call('GET', KEYS[4]) or '' end
if ARGV[7] ~= '' and found ~= ARGV[7] then
  if cur then return {'refused', found} end
  return {'refused'}
end
local pttl = -2
local removed_token, removed_owner = '', ''
if cur then
  pttl = redis.call('PTTL', KEYS[1])
  redis.call('DEL', KEYS[1])
  local keep = pttl
  if keep < 0 then keep = tonumber(ARGV[6]) end
  redis.call('SET', KEYS[2], cur, 'PX', keep + 1000)
  redis.pcall('PUBLISH', ARGV[1], 'forced')
  removed_token = found
  removed_owner = owner or ''
end
redis.call('XADD', KEYS[3], 'MAXLEN', ARGV[5], '*',
  'actor', ARGV[2], 'reason', ARGV[3], 'at_ms', ARGV[4],
  'removed_token', removed_token, 'removed_owner', removed_owner)
if cur then return {cur, pttl, found} end
return {}
";

/// Fence write or claim: `KEYS = [fence]`, `ARGV = [token, 'w' | 'c', value]`.
///
/// Accepts when `token >= newest` (an equal token is accepted), setting `newest` (and for a write
/// `vtoken` and `value`) in the same step; returns `{1, previous_newest or ''}`. Otherwise changes
/// nothing and returns `{0, newest}`. A claim with the current token writes `newest` again, so
/// that a `WAIT` after it (with `replica_acks`) covers it even when this connection had not
/// written it: a resend on a new connection, or a claim repeated after one too few replicas had.
///
/// `ARGV = ['', 's', '']` settles instead: it writes `newest` again, unchanged, when there is
/// one, and returns `{1, newest or ''}`. Sent after a write whose reply was lost and whose
/// connection was ended, it makes a `WAIT` after it cover whatever that write did (the
/// replication stream is ordered; see [`crate::client::Connection::eval_and_wait`]). A fence
/// without `newest` had nothing written, so there is nothing to wait for.
const FENCE_BODY: &str = r"
local newest = redis.call('HGET', KEYS[1], 'newest')
if ARGV[2] == 's' then
  if newest then redis.call('HSET', KEYS[1], 'newest', newest) end
  return {1, newest or ''}
end
if newest and lt(ARGV[1], newest) then return {0, newest} end
if ARGV[2] == 'w' then
  redis.call('HSET', KEYS[1], 'newest', ARGV[1], 'vtoken', ARGV[1], 'value', ARGV[3])
else
  redis.call('HSET', KEYS[1], 'newest', ARGV[1])
end
return {1, newest or ''}
";

/// Each script's source by operation name, exactly as sent (see [`crate::script_source`]).
static SOURCES: LazyLock<[(&str, String); 6]> = LazyLock::new(|| {
    [
        ("acquire", format!("{LT}{INC}{ACQUIRE_BODY}")),
        ("renew", format!("{RENEW_BODY}{NOT_OURS}")),
        ("renew_many", RENEW_MANY_SRC.to_owned()),
        ("release", format!("{RELEASE_BODY}{NOT_OURS}")),
        ("force_release", FORCE_RELEASE_SRC.to_owned()),
        ("fence", format!("{LT}{FENCE_BODY}")),
    ]
});

/// The source of the script run for `operation`, one of the names in [`SOURCES`].
pub(crate) fn source(operation: &str) -> Option<&'static str> {
    SOURCES
        .iter()
        .find(|(name, _)| *name == operation)
        .map(|(_, src)| src.as_str())
}

fn script(operation: &str) -> Script {
    Script::new(source(operation).expect("a script of this module"))
}

pub(crate) static ACQUIRE: LazyLock<Script> = LazyLock::new(|| script("acquire"));
pub(crate) static RENEW: LazyLock<Script> = LazyLock::new(|| script("renew"));
pub(crate) static RENEW_MANY: LazyLock<Script> = LazyLock::new(|| script("renew_many"));
pub(crate) static RELEASE: LazyLock<Script> = LazyLock::new(|| script("release"));
pub(crate) static FORCE_RELEASE: LazyLock<Script> = LazyLock::new(|| script("force_release"));
pub(crate) static FENCE: LazyLock<Script> = LazyLock::new(|| script("fence"));

/// How many entries each lock's audit stream keeps.
pub(crate) const AUDIT_MAXLEN: usize = lease_core::AuditRecord::MAX_LIMIT;

/// Reply helpers: script replies are arrays of integers and bulk strings.
pub(crate) mod reply {
    use redis::Value;

    /// The elements of an array reply.
    pub(crate) fn array(v: Value) -> Option<Vec<Value>> {
        match v {
            Value::Array(items) | Value::Set(items) => Some(items),
            Value::Nil => Some(Vec::new()),
            _ => None,
        }
    }

    /// An integer reply (or a decimal string).
    pub(crate) fn int(v: &Value) -> Option<i64> {
        match v {
            Value::Int(i) => Some(*i),
            other => text(other)?.parse().ok(),
        }
    }

    /// A string reply, as UTF-8.
    pub(crate) fn text(v: &Value) -> Option<String> {
        match v {
            Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
            Value::SimpleString(s) => Some(s.clone()),
            Value::VerbatimString { text, .. } => Some(text.clone()),
            _ => None,
        }
    }

    /// A byte-string reply.
    pub(crate) fn bytes(v: Value) -> Option<Vec<u8>> {
        match v {
            Value::BulkString(b) => Some(b),
            Value::SimpleString(s) => Some(s.into_bytes()),
            _ => None,
        }
    }
}
