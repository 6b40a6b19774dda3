// The console's only script: refresh the live parts of a page without reloading it, and
// (un)check every box of a selection. It inserts only HTML the console rendered (escaped on
// the server) and runs on the console's own origin (the Content-Security-Policy allows nothing
// else).
"use strict";

function refresh(element) {
  const url = element.getAttribute("data-refresh");
  const seconds = Number(element.getAttribute("data-interval") || "5");
  async function once() {
    try {
      const response = await fetch(url, { credentials: "same-origin", cache: "no-store" });
      const type = response.headers.get("content-type") || "";
      if (response.ok && type.startsWith("text/html") && !response.redirected) {
        element.innerHTML = await response.text();
        element.setAttribute("data-refreshed", new Date().toISOString());
        element.classList.remove("stale");
      } else {
        element.classList.add("stale");
      }
    } catch (error) {
      element.classList.add("stale");
    }
    window.setTimeout(once, seconds * 1000);
  }
  window.setTimeout(once, seconds * 1000);
}

function selectAll(box) {
  const form = box.form;
  for (const other of form.querySelectorAll("input[type=checkbox][name='" + box.value + "']")) {
    other.checked = box.checked;
  }
}

document.addEventListener("DOMContentLoaded", function () {
  for (const element of document.querySelectorAll("[data-refresh]")) {
    refresh(element);
  }
  for (const box of document.querySelectorAll("input[type=checkbox][data-select-all]")) {
    box.addEventListener("change", function () { selectAll(box); });
  }
});
