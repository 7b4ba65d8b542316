// A Node.js client of prism.v1.InferenceService and ResponsesService, built only from
// protos/ at run time (@grpc/proto-loader), as a user of another language would:
// `node client.mjs ADDRESS MODEL IMAGE.png` prints what each call got, as JSON.
import { readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import path from "node:path";
import grpc from "@grpc/grpc-js";
import protoLoader from "@grpc/proto-loader";

const [address, model, imagePath] = process.argv.slice(2);
const protos = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../../../protos");
const definition = protoLoader.loadSync(["prism/v1/inference.proto", "prism/v1/responses.proto"], {
  includeDirs: [protos], keepCase: true, longs: String, enums: String, defaults: true,
  oneofs: true,
});
const { InferenceService, ResponsesService } = grpc.loadPackageDefinition(definition).prism.v1;
const client = new InferenceService(address, grpc.credentials.createInsecure());
const responses = new ResponsesService(address, grpc.credentials.createInsecure());

function chat(image, { model: name = model, maxTokens = 12, ignoreEos = false, id = "" } = {}) {
  return {
    request_id: id,
    model: name,
    messages: [{
      role: "ROLE_USER",
      content: [{ image: { data: image, mime_type: "image/png" } }, { text: "What is this?" }],
    }],
    sampling: { temperature: 0, max_tokens: maxTokens, ignore_eos: ignoreEos },
  };
}

// Reads a Chat stream to its end; `onFirst` runs at its first message.
function read(request, onFirst = () => {}) {
  return new Promise((resolve) => {
    const call = client.Chat(request);
    const out = { text: "", messages: 0, finish_reason: null, usage: null, error: null };
    call.on("data", (message) => {
      if (out.messages++ === 0) onFirst(call);
      out.text += message.text;
      if (message.finish_reason !== "FINISH_REASON_UNSPECIFIED") {
        out.finish_reason = message.finish_reason;
        out.usage = message.usage;
      }
    });
    call.on("error", (error) => {
      out.error = { code: grpc.status[error.code], details: error.details };
      resolve(out);
    });
    call.on("end", () => resolve(out));
  });
}

const unary = (method, request, service = client) =>
  new Promise((resolve, reject) =>
    service[method](request, (error, reply) => (error ? reject(error) : resolve(reply))));

// A Responses API request with the image, streamed: the events' types, the last event.
function respond(image) {
  const body = {
    model, max_output_tokens: 12, temperature: 0, stream: true,
    input: [{ role: "user", content: [
      { type: "input_image", image_url: `data:image/png;base64,${image.toString("base64")}` },
      { type: "input_text", text: "What is this?" },
    ] }],
  };
  return new Promise((resolve) => {
    const call = responses.Respond({ request: JSON.stringify(body) });
    const out = { types: [], last: null, error: null };
    call.on("data", (message) => {
      out.last = JSON.parse(message[message.answer]);
      out.types.push(out.last.type);
    });
    call.on("error", (error) => {
      out.error = { code: grpc.status[error.code], details: error.details };
      resolve(out);
    });
    call.on("end", () => resolve(out));
  });
}

const image = readFileSync(imagePath);
const result = {};
result.models = (await unary("ListModels", {})).models.map((m) => m.id);
result.chat = await read(chat(image));
result.cancelled = await read(chat(image, { maxTokens: 2000, ignoreEos: true }),
  (call) => call.cancel());
const id = `node-abort-${process.pid}`;
result.aborted = await read(chat(image, { maxTokens: 2000, ignoreEos: true, id }), () => {
  unary("Abort", { request_id: id }).then((reply) => { result.abort_found = reply.aborted; });
});
result.unknown_model = await read(chat(image, { model: "no-such-model" }));
result.broken_image = await read(chat(Buffer.from("not an image at all")));
result.responses = await respond(image);
const stored = result.responses.last?.response?.id ?? "";
result.stored = JSON.parse((await unary("GetResponse", { response_id: stored }, responses)).response);
client.close();
responses.close();
console.log(JSON.stringify(result));
