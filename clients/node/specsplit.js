'use strict';
// A specsplit client in Node.js, built from proto/specsplit/v1/speculative.proto alone: the .proto
// is loaded at run time (no generated code), and every rule below comes from its comments.
//
// generate() runs one generation on one bidirectional stream:
//   Start -> Started, then (split) Draft{round, base_len, tokens} -> Verdict per round, or
//   (session mode CLOUD_ONLY) a Verdict per token, until a Verdict with finished; then Finished, and the
//   client half-closes. Drafts come from the caller (`drafts`: blocks sent in order; once they
//   run out, empty blocks, each asking the cloud for one target token).

const path = require('node:path');
const fs = require('node:fs');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO = path.resolve(__dirname, '../../proto/specsplit/v1/speculative.proto');

function loadProtocol(protoPath = PROTO) {
  const definition = protoLoader.loadSync(protoPath, {
    keepCase: true, // field names as in the .proto (base_len, not baseLen)
    longs: String, // uint64 seed: a decimal string, exact beyond 2^53
    enums: String, // 'FINISH_REASON_LENGTH', not 3
    defaults: true, // unset scalars read as their proto3 defaults (has_token false, ...)
    oneofs: true, // msg.msg names the field set in a oneof ('started', 'verdict', ...)
  });
  return grpc.loadPackageDefinition(definition).specsplit.v1;
}

// A client of the gateway at `address` (HOST:PORT). TLS when `tlsCa` (a PEM file) is given.
function connect(address, { tlsCa, protoPath } = {}) {
  const v1 = loadProtocol(protoPath);
  const credentials = tlsCa
    ? grpc.credentials.createSsl(fs.readFileSync(tlsCa))
    : grpc.credentials.createInsecure();
  return new v1.SpeculativeDecoding(address, credentials);
}

class GenerationError extends Error {
  constructor(message, code) {
    super(message);
    this.code = code; // a grpc.status value when the server ended the stream with an error
  }
}

// One generation. Resolves to { token_ids, rounds, drafted, accepted, finish,
// target_forward_passes, seed, model }; rejects with a GenerationError.
async function generate(client, {
  promptIds,
  maxNewTokens = 32,
  temperature = 0,
  seed, // a decimal string or number; absent: the server picks one (returned in seed)
  cloudOnly = false,
  drafts = [], // [[d_1..d_k], ...]: the blocks to send, in order
  token, // bearer token, for a gateway that requires one
} = {}) {
  const metadata = new grpc.Metadata();
  if (token) metadata.set('authorization', `Bearer ${token}`);
  const call = client.Generate(metadata);
  const sampling = { temperature, max_new_tokens: maxNewTokens };
  if (seed !== undefined) sampling.seed = String(seed);
  call.write({
    start: {
      protocol_version: 'PROTOCOL_VERSION_1',
      prompt_ids: promptIds,
      sampling,
      session_mode: cloudOnly ? 'SESSION_MODE_CLOUD_ONLY' : 'SESSION_MODE_LOCK_STEP',
    },
  });

  const committed = [...promptIds]; // the prompt, then every committed token
  const out = { token_ids: [], rounds: 0, drafted: 0, accepted: 0 };
  let limits = null;
  let sent = null; // the block of the Draft in flight
  const sendDraft = () => {
    // The Draft continues from everything committed so far: base_len is the committed_len of the
    // last Verdict (Started.committed_len, the prompt length, before the first one).
    let tokens = drafts[out.rounds] || [];
    tokens = tokens.slice(0, limits.max_draft_tokens);
    sent = tokens;
    call.write({ draft: { round: out.rounds + 1, base_len: committed.length, tokens } });
  };

  try {
    for await (const msg of call) {
      if (msg.msg === 'started') {
        const s = msg.started;
        limits = s.limits;
        out.seed = s.seed;
        out.model = s.model.name;
        if (s.committed_len !== committed.length) {
          throw new GenerationError(`Started.committed_len ${s.committed_len} != prompt length`);
        }
        if (!cloudOnly) sendDraft();
      } else if (msg.msg === 'verdict') {
        const v = msg.verdict;
        // The Verdict keeps the first `accepted` drafts and appends its token, if it has one.
        const chunk = cloudOnly ? [] : sent.slice(0, v.accepted);
        if (v.has_token) chunk.push(v.token);
        committed.push(...chunk);
        out.token_ids.push(...chunk);
        out.rounds += 1;
        out.drafted += cloudOnly ? 0 : sent.length;
        out.accepted += v.accepted;
        if (v.committed_len !== committed.length) {
          throw new GenerationError(`committed_len ${v.committed_len} != ${committed.length}`);
        }
        if (!v.finished && !cloudOnly) sendDraft();
      } else if (msg.msg === 'finished') {
        out.finish = msg.finished.reason.replace('FINISH_REASON_', '');
        out.target_forward_passes = msg.finished.target_forward_passes;
        call.end(); // half-close: the server then ends the stream with OK
      }
    }
  } catch (e) {
    call.cancel();
    if (e instanceof GenerationError) throw e;
    throw new GenerationError(`${grpc.status[e.code] || 'ERROR'}: ${e.details || e.message}`, e.code);
  }
  if (out.finish === undefined) throw new GenerationError('stream ended before Finished');
  return out;
}

module.exports = { PROTO, loadProtocol, connect, generate, GenerationError };
