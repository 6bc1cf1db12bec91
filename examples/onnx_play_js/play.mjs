// Play a Phalanx policy exported to ONNX from Node.js, with onnxruntime-node alone (no Python, no PyTorch).
//
//   ONNXRUNTIME_NODE_INSTALL=skip npm install      # in this folder: the CPU build the package ships, no download
//   node play.mjs PACKAGE_DIR STEPS.json           # prints one JSON line per step: {"action": [...], "dims": [...]}
//
// PACKAGE_DIR holds policy.onnx and its contract policy.json (`phalanx export RUN --package DIR`, or the folder of
// `phalanx export RUN --out DIR/policy.onnx`). STEPS.json is a list of steps, each {"obs": [batch][slot][...]} with,
// where the contract takes them, "action_mask" (true: allowed), "episode_start" and "active" ([batch][slot] booleans).
// A memory model's memory starts as the contract says and is carried from step to step, as Phalanx's does: the graph
// resets a slot's memory where episode_start is true.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import * as ort from "onnxruntime-node";

const TYPES = { float32: Float32Array, uint8: Uint8Array, bool: Uint8Array, int64: BigInt64Array };

function tensor(spec, values, batch) {
  const shape = [batch, ...spec.shape.slice(1)];
  const flat = [values].flat(Infinity).map(Number);
  if (!(spec.dtype in TYPES)) throw new Error(`input ${spec.name}: dtype ${spec.dtype} is not handled here`);
  return new ort.Tensor(spec.dtype, TYPES[spec.dtype].from(flat), shape);
}

function initialMemory(contract, specs, batch) {
  const memory = {};
  for (const field of Object.values(contract.memory)) {
    const spec = specs[field.input];
    const shape = [batch, ...spec.shape.slice(1)];
    const size = shape.reduce((a, b) => a * b, 1);
    const start = [field.initial].flat(Infinity).map(Number); // one value, or one per slot and cell
    const data = new TYPES[spec.dtype](size);
    for (let i = 0; i < size; i++) data[i] = spec.dtype === "int64" ? BigInt(start[i % start.length]) : start[i % start.length];
    memory[field.input] = new ort.Tensor(spec.dtype, data, shape);
  }
  return memory;
}

const [dir, stepsPath] = process.argv.slice(2);
if (!dir || !stepsPath) {
  console.error("usage: node play.mjs PACKAGE_DIR STEPS.json");
  process.exit(2);
}
const contract = JSON.parse(readFileSync(join(dir, "policy.json"), "utf8"));
const session = await ort.InferenceSession.create(join(dir, "policy.onnx"), { intraOpNumThreads: 1 });
const specs = Object.fromEntries(contract.inputs.map((s) => [s.name, s]));
const steps = JSON.parse(readFileSync(stepsPath, "utf8"));
const batch = steps[0].obs.length;
let memory = initialMemory(contract, specs, batch);
for (const step of steps) {
  const feeds = { ...memory };
  for (const name of ["obs", "action_mask", "episode_start", "active"]) {
    if (name in specs) feeds[name] = tensor(specs[name], step[name], batch);
  }
  const out = await session.run(feeds);
  memory = Object.fromEntries(Object.values(contract.memory).map((f) => [f.input, out[f.output]]));
  console.log(JSON.stringify({ action: Array.from(out.action.data, Number), dims: out.action.dims }));
}
